"""The request fields each OpenAI API reads, and the counter of those it does not: a field a client sends
that the gateway neither honours nor refuses is counted per request (`gateway_ignored_fields:<name>`), the
name from a fixed list of the API's known fields, anything else `other`, so that a client cannot mint
counters. The README's gateway section has the tables."""

from __future__ import annotations

from typing import Any

CHAT_READ = frozenset({"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
                       "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "n", "stream",
                       "stream_options"})
CHAT_IGNORED = ("user", "metadata", "store", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty",
                "logit_bias", "service_tier", "reasoning_effort", "modalities", "audio", "prediction",
                "web_search_options", "safety_identifier", "prompt_cache_key", "verbosity", "functions",
                "function_call")
RESPONSES_READ = frozenset({"model", "input", "instructions", "previous_response_id", "tools", "tool_choice",
                            "parallel_tool_calls", "text", "include", "max_output_tokens", "temperature", "top_p",
                            "stream", "store", "metadata"})
RESPONSES_IGNORED = ("reasoning", "prompt_cache_key", "client_metadata", "user", "safety_identifier", "service_tier",
                     "truncation", "background", "top_logprobs", "max_tool_calls", "stream_options", "prompt",
                     "conversation", "prompt_cache_retention")


def ignored_fields(body: dict[str, Any], read: frozenset[str], known: tuple[str, ...]) -> dict[str, int]:
    """One count per ignored field of this request, under a bounded label."""
    counters: dict[str, int] = {}
    for name in body:
        if name not in read and body[name] is not None:
            counters[f"gateway_ignored_fields:{name if name in known else 'other'}"] = 1
    return counters
