"""Rollout runtime: job streams, worker loops, engine clients, and the legacy (slime) runner.

`RolloutRuntime` and `build_runtime` are imported on first use, so that a process needing only a light
part of the package (the worker supervisor) does not import the rollout machinery with it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RolloutRuntime", "build_runtime"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rollout_buffer.runtime import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
