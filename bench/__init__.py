"""Benchmarks (`python -m bench`). Every `serve` a benchmark starts runs one API process unless the row
names its own `--api-processes` (the scale rows do): the rows' targets and baselines were set against one,
and more processes would share the same few cores with the load generator and the engine."""

import os

os.environ.setdefault("ROLLOUT_BUFFER_API_PROCESSES", "1")
