"""Rollout runtime: task streams, worker loops, engine clients, and the legacy (slime) runner."""

from rollout_buffer.runtime.service import RolloutRuntime, build_runtime

__all__ = ["RolloutRuntime", "build_runtime"]
