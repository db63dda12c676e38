"""The trainer side of the rollout buffer: slime's rollout function and what it is built from.

Start at `agent_rollout.generate_rollout` (slime's `--rollout-function-path`) and `settings.py` (every
setting it reads from slime's `args`, with its default). The folders, lowest first; each imports only the
ones before it (`tests/test_layout.py` checks this):

- `masks/`: the message path's tokens and loss mask, re-derived from chat messages with the chat template;
- `reading/`: reading from the buffer: the HTTP client, keeping leases, checks on a run that cannot deliver;
- `samples/`: trajectory records into training `Sample`s (token path, message path), and dense collation;
- `hooks/`: slime's side: `generate_rollout` and evaluation, a step's intake, the dynamic sampling filter,
  over-sampling surplus, `rollout/` metrics and slime's output classes.

`auth.py` (where the buffer's token comes from) and `settings.py` sit at the root; `agent_rollout.py` and
`collate.py` there keep the documented import paths.
"""
