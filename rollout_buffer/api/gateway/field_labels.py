"""Bounded stat labels for the fields a client sends that the gateway does not read.

A counter named after a client's own words grows without limit (a body of 10,000 invented fields made
10,000 counters). A field is counted by name only when the API it was sent to defines it (the vendors'
published request fields, listed here); any other name is counted as `other`. So the labels of
`gateway_ignored_fields:<name>` are at most these lists plus one.
"""

from __future__ import annotations

from collections.abc import Iterable

OTHER = "other"
IGNORED_PREFIX = "gateway_ignored_fields:"

# Anthropic Messages (`POST /v1/messages`) request fields, as Anthropic's API reference and SDKs define them.
ANTHROPIC_MESSAGES = frozenset({
    "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream", "temperature", "top_k",
    "top_p", "tools", "tool_choice", "thinking", "service_tier", "container", "mcp_servers", "context_management",
    "output_config", "output_format", "inference_geo"})

# OpenAI Chat Completions (`POST /v1/chat/completions`) request fields.
OPENAI_CHAT = frozenset({
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options"})

# OpenAI Responses (`POST /v1/responses`) request fields.
OPENAI_RESPONSES = frozenset({
    "background", "conversation", "include", "input", "instructions", "max_output_tokens", "max_tool_calls",
    "metadata", "model", "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key",
    "reasoning", "safety_identifier", "service_tier", "store", "stream", "stream_options", "temperature", "text",
    "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user"})

DEFINED: dict[str, frozenset[str]] = {"anthropic": ANTHROPIC_MESSAGES, "openai": OPENAI_CHAT,
                                      "responses": OPENAI_RESPONSES}


def label(api: str, name: str) -> str:
    """`name` when `api` defines such a field, else `other`."""
    return name if name in DEFINED[api] else OTHER


def ignored_field_stats(api: str, names: Iterable[str]) -> dict[str, int]:
    """The stat increments for ignored fields `names` of one request to `api`: one per bounded label, so a
    counter counts the requests that sent such a field (`other`: any field the API does not define)."""
    return {IGNORED_PREFIX + label(api, name): 1 for name in names}
