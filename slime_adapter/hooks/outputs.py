"""What the rollout function returns: slime's output classes when slime has them, the plain value otherwise.

slime's `call_rollout_fn` accepts both: a `RolloutFnTrainOutput(samples, metrics)` /
`RolloutFnEvalOutput(data, metrics)` (`slime.rollout.base_types`), or, from older rollout functions, the
bare samples / eval dict, which it wraps itself (without metrics). Returning the classes hands slime the
adapter's `rollout/` and `eval/` metrics, which slime then logs with its own (wandb, tensorboard) at its
own step; the adapter then does not log them to wandb a second time.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["eval_output", "slime_outputs_available", "train_output"]

BASE_TYPES = "slime.rollout.base_types"


def _base_types() -> Any | None:
    try:
        return importlib.import_module(BASE_TYPES)
    except ImportError:
        return None


def slime_outputs_available() -> bool:
    """Whether this slime has `RolloutFnTrainOutput` / `RolloutFnEvalOutput`."""
    module = _base_types()
    return module is not None and hasattr(module, "RolloutFnTrainOutput") and hasattr(module, "RolloutFnEvalOutput")


def train_output(samples: list[list[Any]], metrics: dict[str, Any] | None) -> Any:
    """`RolloutFnTrainOutput(samples, metrics)` when slime has it, else `samples`."""
    if not slime_outputs_available():
        return samples
    return _base_types().RolloutFnTrainOutput(samples=samples, metrics=metrics)


def eval_output(data: dict[str, dict[str, Any]], metrics: dict[str, Any] | None) -> Any:
    """`RolloutFnEvalOutput(data, metrics)` when slime has it, else `data`."""
    if not slime_outputs_available():
        return data
    return _base_types().RolloutFnEvalOutput(data=data, metrics=metrics)
