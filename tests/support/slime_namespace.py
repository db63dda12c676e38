"""slime's `args` as its parser builds them, for the attributes the adapter reads.

The defaults are slime's own (`slime/utils/arguments.py`: `--input-key input`, `--label-key None`,
`--metadata-key metadata`, `--tool-key tools`, `--rollout-top-k -1`, `--min-batch-collection-ratio 1`,
`--disable-rewards-normalization` storing `rewards_normalization=False`, `--n-samples-per-eval-prompt 1`,
the `eval_*` overrides None, `eval_datasets` set by `slime_validate_args`, ...); `dapo_overrides` is a
dapo-math-17k setup (`--input-key prompt --label-key label --apply-chat-template`, `--tool-key` unset).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import pytest

SLIME_DEFAULTS: dict[str, Any] = {
    "rollout_buffer_url": None, "fetch_trajectory_retry_times": -1, "min_batch_collection_ratio": 1.0,
    "rollout_task_type": "math", "loss_mask_type": "qwen",
    "prompt_data": None, "input_key": "input", "label_key": None, "metadata_key": "metadata", "tool_key": "tools",
    "apply_chat_template": False, "apply_chat_template_kwargs": {}, "multimodal_keys": None,
    "rollout_batch_size": 1, "n_samples_per_prompt": 1, "num_epoch": None, "num_rollout": None,
    "rollout_temperature": 1.0, "rollout_top_p": 1.0, "rollout_top_k": -1, "rollout_max_response_len": None,
    "rollout_stop": None, "rollout_stop_token_ids": None, "rollout_skip_special_tokens": False, "rollout_seed": 42,
    "rewards_normalization": True, "advantage_estimator": "grpo", "reward_key": None, "eval_reward_key": None,
    "eval_prompt_data": None, "eval_config": None, "eval_datasets": [], "n_samples_per_eval_prompt": 1,
    "eval_temperature": None, "eval_top_p": None, "eval_top_k": None, "eval_max_response_len": None,
    "eval_min_new_tokens": None, "eval_input_key": None, "eval_label_key": None, "eval_tool_key": None,
    "use_wandb": False, "wandb_project": None, "wandb_group": None, "wandb_always_use_train_step": False,
    "global_batch_size": None, "hf_checkpoint": None, "sglang_router_ip": None, "sglang_router_port": None,
}
DAPO_OVERRIDES: dict[str, Any] = {"input_key": "prompt", "label_key": "label", "metadata_key": "metadata",
                                  "tool_key": None, "apply_chat_template": True}


def slime_namespace(**overrides: Any) -> SimpleNamespace:
    """slime's defaults with `overrides`; `engine_url="http://h:p"` sets `sglang_router_ip/port`."""
    values = {**SLIME_DEFAULTS}
    engine = overrides.pop("engine_url", None)
    if engine:
        parsed = urlparse(engine)
        values.update(sglang_router_ip=parsed.hostname, sglang_router_port=parsed.port)
    values.update(overrides)
    return SimpleNamespace(**values)


def install_slime_base_types(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Make `slime.rollout.base_types` importable with slime's two output dataclasses, field for field
    (slime itself needs torch and ray, which this machine does not have); undone by `monkeypatch`."""

    @dataclass
    class RolloutFnTrainOutput:
        samples: list[list[Any]]
        metrics: dict[str, Any] | None = None

    @dataclass
    class RolloutFnEvalOutput:
        data: dict[str, dict[str, Any]]
        metrics: dict[str, Any] | None = None

    module = types.ModuleType("slime.rollout.base_types")
    module.RolloutFnTrainOutput = RolloutFnTrainOutput  # type: ignore[attr-defined]
    module.RolloutFnEvalOutput = RolloutFnEvalOutput  # type: ignore[attr-defined]
    for name in ("slime", "slime.rollout"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "slime.rollout.base_types", module)
    return module
