"""The request fields each OpenAI API reads, and the counter of those it does not: a field a client sends
that the gateway neither honours nor refuses is counted per request (`gateway_ignored_fields:<name>`), the
name a bounded label (`field_labels`: one of the API's own fields, anything else `other`), so that a client
cannot mint counters. docs/gateway.md has the tables."""

from __future__ import annotations

from typing import Any

from rollout_buffer.api.gateway.field_labels import ignored_field_stats

CHAT_READ = frozenset({"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
                       "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "n", "stream",
                       "stream_options"})
RESPONSES_READ = frozenset({"model", "input", "instructions", "previous_response_id", "tools", "tool_choice",
                            "parallel_tool_calls", "text", "include", "max_output_tokens", "temperature", "top_p",
                            "stream", "store", "metadata"})


def ignored_fields(body: dict[str, Any], read: frozenset[str], api: str) -> dict[str, int]:
    """One count per ignored field of this request to `api` ("openai", "responses"), under a bounded label."""
    return ignored_field_stats(api, [name for name in body if name not in read and body[name] is not None])
