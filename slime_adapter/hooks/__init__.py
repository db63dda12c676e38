"""slime's side: `generate_rollout` for `--rollout-function-path` and evaluation through the buffer, a
trainer step's intake (`step`: build, the dynamic sampling filter, the over-sampling surplus), `rollout/`
metrics, and slime's output classes. The top of the adapter: it may import every other folder.
"""
