"""The model endpoints' request bodies as this API's OpenAPI schema shows them (`/docs`, and the schema
fuzzer in tests/api/test_fuzz_api.py). The wire modules read the bodies themselves, field by field, as each
vendor's API defines them; these models only document the fields they read (others are accepted, counted or
ignored as the wire modules say), so they allow extra fields and are never used to parse."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Documented(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatCompletionsBody(_Documented):
    """OpenAI Chat Completions (`POST /v1/chat/completions`), with the session's key as the API key."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class MessagesBody(_Documented):
    """Anthropic Messages (`POST /v1/messages`), with the session's key as `x-api-key` or bearer token."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False


class ResponsesBody(_Documented):
    """OpenAI Responses (`POST /v1/responses`); `previous_response_id` names a response of the same session."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
