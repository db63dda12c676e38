"""Bounded sessions: a session stops at its turn, fork and stored-bytes caps (409 naming the cap), and a run
or the server with as many open sessions as allowed answers a create 429 with Retry-After, until sessions
finish."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from rollout_buffer.api.gateway.errors import GatewayError
from rollout_buffer.api.gateway.session_caps import Usage, check_session
from rollout_buffer.settings import Settings
from tests.support.gateway import finish, new_session, start_external
from tests.support.helpers import ServerSpec

SERVER = ServerSpec(args=("--max-session-turns", "3", "--max-session-forks", "1", "--max-open-sessions-per-run", "3",
                          "--max-open-sessions", "5", "--session-timeout-s", "60"))


def _ask(client: httpx.Client, session: dict[str, Any], messages: list[dict[str, Any]]) -> httpx.Response:
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {session['api_key']}"},
                       json={"model": "m", "max_tokens": 4, "messages": messages})


def test_the_stored_bytes_cap() -> None:
    settings = Settings(max_session_mb=1.0)
    check_session(Usage(turns=1, forks=0, bytes=1024 * 1024 - 1), settings)
    with pytest.raises(GatewayError) as caught:
        check_session(Usage(turns=1, forks=0, bytes=1024 * 1024), settings)
    assert caught.value.status == 409 and "--max-session-mb 1.0" in caught.value.message


def test_turn_and_fork_caps(client: httpx.Client, rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=2)
    talker = new_session(client, run_id, "caps-1")
    messages: list[dict[str, Any]] = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"question {turn}"})
        answer = _ask(client, talker, messages)
        assert answer.status_code == 200, answer.text
        messages.append(answer.json()["choices"][0]["message"])
    messages.append({"role": "user", "content": "one more"})
    capped = _ask(client, talker, messages)
    assert capped.status_code == 409 and "--max-session-turns 3" in capped.text, capped.text
    editor = new_session(client, run_id, "caps-1")
    assert _ask(client, editor, [{"role": "user", "content": "first"}]).status_code == 200
    assert _ask(client, editor, [{"role": "user", "content": "edited"}]).status_code == 200  # fork 1
    forked = _ask(client, editor, [{"role": "user", "content": "edited again"}])
    assert forked.status_code == 409 and "--max-session-forks 1" in forked.text, forked.text
    finish(client, talker, 1.0)
    finish(client, editor, 0.0)


def test_open_session_caps(client: httpx.Client, rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    first_run = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=4)
    opened = [new_session(client, first_run, f"open-{i}") for i in range(3)]
    full = client.post(f"/runs/{first_run}/sessions", json={"instance_id": "open-x"})
    assert full.status_code == 429 and "--max-open-sessions-per-run 3" in full.text, full.text
    assert int(full.headers["retry-after"]) > 0
    finish(client, opened[0], 1.0)
    opened[0] = new_session(client, first_run, "open-again")  # one finished: room again
    second_run = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=4)
    more = [new_session(client, second_run, f"other-{i}") for i in range(2)]
    crowded = client.post(f"/runs/{second_run}/sessions", json={"instance_id": "other-x"})
    assert crowded.status_code == 429 and "--max-open-sessions 5" in crowded.text, crowded.text
    for session in opened + more:
        finish(client, session, 0.0)
