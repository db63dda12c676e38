"""The gateway takes a request shaped like Claude Code's (2.1.197): mid-conversation system messages,
cache_control on blocks, `thinking`, `context_management`, `output_config`, `metadata`, beta headers and a
`max_tokens` far above the run's limit. It answers (never a 4xx for a field the real client sends), clamps
the limit, ignores and counts what it does not implement, and records the system message in place."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from tests.support.gateway import engine_calls_of, finish, new_session, read_group, start_external
from tests.support.helpers import ServerProcess, ServerSpec

BASH = {"name": "Bash", "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
CLAUDE_CODE_EXTRAS = {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
                      "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                      "metadata": {"user_id": "{\"device_id\": \"d\", \"session_id\": \"s\"}"}}


SERVER = ServerSpec(args=("--agent-sandbox", "local"))


def test_a_claude_code_shaped_request_is_answered(server: ServerProcess, rollout_engine: Any,
                                                  qwen_tokenizer_path: str) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1,
                                sampling_params={"max_tokens": 6, "temperature": 1.0})
        session = new_session(client, run_id, "cc")
        sdk = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
        messages = [{"role": "user", "content": [
                        {"type": "text", "text": "<system-reminder>\nToday is 2026-11-24.\n</system-reminder>\n"},
                        {"type": "text", "text": "What is 6 * 7?", "cache_control": {"type": "ephemeral"}}]},
                    {"role": "system", "content": "Available agent types: general-purpose."}]
        with sdk.messages.stream(model="claude-opus-4-8", max_tokens=64000, messages=messages, tools=[BASH],
                                 system=[{"type": "text", "text": "You are a Claude agent.",
                                          "cache_control": {"type": "ephemeral"}}],
                                 extra_body=CLAUDE_CODE_EXTRAS,
                                 extra_headers={"anthropic-beta": "claude-code-20250219,context-management-2025-06-27"},
                                 ) as events:
            reply = events.get_final_message()
        assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 6, "clamped to the run's limit"
        [call] = engine_calls_of(rollout_engine, session["session_id"])
        assert len(call["output_ids"]) == 6
        finish(client, session, 0.0)
        [record] = read_group(client, run_id, 1)
        stats = client.get(f"/runs/{run_id}").json()["stats"]
    assert [m["role"] for m in record["messages"]] == ["system", "user", "system", "assistant"]
    assert record["messages"][2]["content"] == "Available agent types: general-purpose."
    assert record["messages"][1]["content"].endswith("What is 6 * 7?")
    assert {k: v for k, v in stats.items() if k.startswith("gateway_ignored_fields:")} == {
        f"gateway_ignored_fields:{name}": 1 for name in CLAUDE_CODE_EXTRAS}


def test_other_roles_are_still_refused(server: ServerProcess, rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
        session = new_session(client, run_id, "roles")
        answer = httpx.post(f"{session['anthropic_base_url']}/v1/messages", headers={"x-api-key": session["api_key"]},
                            json={"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
                            timeout=30)
    assert answer.status_code == 400 and "messages.0.role" in answer.text
