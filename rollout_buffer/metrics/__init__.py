"""Observability: what `/metrics`, the dashboard (`GET /`) and `rollout-buffer status` show.

The buffer's truth is Redis, so every number here is recorded per run in Redis where it happens and read
back by whichever process answers: counters and histogram buckets live in the run's `stats` hash (a
rollout's go into the task-finish script it already runs, a read's into one script per read), per-read
summaries in a bounded list (`keys.read_log`), throughput samples in another (`keys.timeline`). Any API
process, with workers in any number of processes on any number of hosts, renders the same numbers, and a
deleted run's series disappear with its keys.

* `histograms`: bucket layouts, observing into a counter dict, reading back from `stats`
* `snapshot`: one pipelined read of every run's state
* `prometheus`: the snapshot as Prometheus metric families
* `readlog`: per-read summaries (reward, staleness, hand-over delay)
* `timeline`: throughput samples taken by the upkeep loop
* `dashboard`: the JSON the dashboard page and `rollout-buffer status` show
"""
