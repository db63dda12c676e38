"""Wire format shared by the service and the trainer side (slime-compatible).

These pydantic models are the single definition of what crosses HTTP. `slime_adapter` may import this
module for types; it imports nothing else from `rollout_buffer`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RecordStatus = Literal["completed", "truncated", "aborted", "failed"]
STATUSES: tuple[str, ...] = ("completed", "truncated", "aborted", "failed")


class Turn(BaseModel):
    """One engine call, token-exact: what the model saw and what it sampled."""

    model_config = ConfigDict(extra="ignore")

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float] | None = None
    finish_reason: str | None = None
    weight_version: str | int | None = None

    @model_validator(mode="after")
    def _logprobs_match_outputs(self) -> "Turn":
        if self.output_logprobs is not None and len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"turns[].output_logprobs has {len(self.output_logprobs)} values for "
                f"{len(self.output_ids)} output_ids"
            )
        if self.output_logprobs:
            # One C-speed pass: the sum is NaN or +inf exactly when some value is NaN or +inf.
            total = sum(self.output_logprobs)
            if total != total or total == math.inf:
                raise ValueError("turns[].output_logprobs must be finite numbers (or -inf)")
        return self


class TrajectoryRecord(BaseModel):
    """One finished rollout of one prompt: the unit `/buffer/write` stores."""

    model_config = ConfigDict(extra="allow")

    uid: str = Field(min_length=1)
    instance_id: str = Field(min_length=1)
    messages: list[dict[str, Any]]
    reward: float
    extra_info: dict[str, Any] = Field(default_factory=dict)
    status: RecordStatus = "completed"
    finish_reason: str | None = None
    raw_reward: float | None = None
    tools: list[dict[str, Any]] | None = None
    weight_version: str | int | None = None
    timestamp: float | None = None
    turns: list[Turn] | None = None
    run_id: str | None = None
    epoch: int | None = None

    def to_store(self) -> dict[str, Any]:
        """The record as the store packs it: plain fields, and the validated turn objects as they are
        (no copy of thousands of token ids into dicts first)."""
        data = self.model_dump(exclude={"turns"})
        data["turns"] = self.turns
        return data

    @field_validator("instance_id", "uid", mode="before")
    @classmethod
    def _ids_as_text(cls, value: Any) -> Any:
        # slime's data files carry integer instance ids; the buffer keys everything by text.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value

    @field_validator("reward", "raw_reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number (got NaN or infinity)")
        return value

    @field_validator("messages")
    @classmethod
    def _messages_have_roles(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(value):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] has no string 'role'")
        return value


class StartRolloutRequest(BaseModel):
    """Body of `/start_rollout`. slime sends every value as text; pydantic coerces."""

    model_config = ConfigDict(extra="allow")

    task_type: str = Field(min_length=1)
    input_file: str = Field(min_length=1)
    num_process: int = Field(default=32, ge=1, le=65536)
    num_epoch: int = Field(default=1, ge=1, le=1_000_000)
    num_repeat_per_sample: int = Field(default=1, ge=1, le=4096)
    remote_engine_url: str = ""
    remote_buffer_url: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    tokenizer_path: str | None = None
    skip_instance_ids: list[str] = Field(default_factory=list)
    run_id: str | None = None
    min_valid_group_size: int | None = Field(default=None, ge=1)

    @field_validator("skip_instance_ids", mode="before")
    @classmethod
    def _skip_ids_as_text(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, list):
            return [str(v) for v in value]
        return value

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _sampling_params_dict(cls, value: Any) -> Any:
        return {} if value is None else value


class GetRolloutDataRequest(BaseModel):
    """Body of `/get_rollout_data`: `{}` reads every ready group."""

    model_config = ConfigDict(extra="allow")

    num: int | None = Field(default=None, ge=1)
    wait_s: float = Field(default=0.0, ge=0.0, le=3600.0)
    run_id: str | None = None


class BatchWriteRequest(BaseModel):
    """Body of `/buffer/write_batch`: many records of one run in one request."""

    records: list[TrajectoryRecord] = Field(min_length=1, max_length=10_000)
    run_id: str | None = None

