"""The chaos harness: faults of every kind at random, at once, while a real trainer works; a checker that
reads the whole history (`python -m bench.chaos`, README "Delivery under faults").

`scheduler` (which fault when, from a seed), `proxy` (the network between trainer and buffer), `services`
(the processes under test and their injectors), `forkserver` (how the killed processes start again),
`trainer` (the trainer process), `agents` (gateway sessions), `harness` (rounds),
`checker` (the proof), `failover` (a Redis Cluster primary killed under load).
"""
