"""Wire format of the remote-rollout protocol: the `/init` body and the completion callback body."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from rollout_buffer.wire.strict import StrictBody

CallbackStatus = Literal["COMPLETED", "ERROR"]
# `rb:remote:index` shares the `rb:remote:` prefix with the per-rollout hashes, so this id is reserved.
RESERVED_IDS = frozenset({"index"})


class InitRequest(StrictBody):
    """`POST /init`: drive one rollout against the trainer's own chat endpoint. Other fields are refused,
    except those the protocol's trainers send that this server does not read (`ACCEPTED_UNREAD`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # the remote-rollout protocol's own examples send these: credentials for a tool server, its own
    # sampling and turn limits (this server's are `sampling_params` and the task's)
    ACCEPTED_UNREAD = frozenset({"api_key", "completion_params", "tool_server_url", "max_turns", "max_tokens_total",
                                 "tokenizer_revision"})

    rollout_id: str = Field(min_length=1, max_length=512)
    server_url: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    tokenizer_name: str = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    task_type: str = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    # Optional per-rollout time limit; the server's --rollout-timeout-s when absent.
    timeout_s: float | None = Field(default=None, gt=0, le=7 * 24 * 3600)

    @field_validator("rollout_id")
    @classmethod
    def _plain_id(cls, value: str) -> str:
        if value in RESERVED_IDS:
            raise ValueError(f"rollout_id {value!r} is reserved")
        if any(ch.isspace() or not ch.isprintable() for ch in value):
            raise ValueError("rollout_id must not contain whitespace or control characters")
        return value

    @field_validator("server_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")) or len(value.split("://", 1)[1].strip("/")) == 0:
            raise ValueError("server_url must be an http(s) URL such as http://host:port")
        return value.rstrip("/")

    @field_validator("messages")
    @classmethod
    def _chat_messages(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for index, message in enumerate(value):
            if not isinstance(message.get("role"), str) or not message["role"]:
                raise ValueError(f"messages[{index}] has no role")
        return value


def callback_body(rollout_id: str, status: CallbackStatus, *, messages: list[dict[str, Any]], reward: float,
                  metadata: dict[str, Any] | None, error: str | None = None) -> dict[str, Any]:
    """The one `POST {server_url}/v1/rollout/completed` body of a rollout."""
    body: dict[str, Any] = {"rollout_id": rollout_id, "status": status, "messages": messages,
                            "reward": reward if math.isfinite(reward) else 0.0}
    if error is not None:
        body["error"] = error
    if metadata is not None:
        body["metadata"] = metadata
    return body
