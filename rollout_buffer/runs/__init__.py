"""A run, from `/start_rollout` to deletion: its lifecycle and the `Runtime` protocol (`lifecycle`), its policy
(`policy`: the staleness bound; `group_filter`: which groups the trainer gets), its reads (`reads`) and
retention (`retention`).

May import `metrics`, `store`, `tasks`, `wire` and `security`; never `api`, `runtime` or `remote` (the
runtime plugs in through `lifecycle.Runtime`).
"""
