"""rollout-buffer: an asynchronous rollout buffer for agentic RL (see README.md)."""

__version__ = "0.1.0"
