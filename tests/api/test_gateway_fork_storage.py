"""What a fork stores is what it adds: a session whose client edits its history keeps one copy of the shared
prefix, live and once finished (its record in Redis), its byte cap counts what is stored, and everything read
back (answers, the finished record by JSON and packed reads, the adapter's samples) is byte for byte what it
was when every fork stored its whole prompt."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.fork_script import play, read_back, stored_digest
from tests.support.helpers import ServerSpec

SERVER = ServerSpec(args=("--session-timeout-s", "120", "--max-session-mb", "0.2"))
CAPTURE = Path(__file__).resolve().parent.parent / "fixtures" / "gateway_forks" / "record.json"


@pytest.fixture(scope="module")
def greedy_engine() -> Iterator[Any]:
    """The test engine with its own seed (no other test reconfigures it); the run samples greedily."""
    from rollout_buffer.testing.engine import run_engine_in_thread

    with run_engine_in_thread(template="qwen2.5", seed=33) as engine:
        yield engine


def test_fork_records_read_back_as_captured(client: httpx.Client, greedy_engine: Any,
                                            qwen_tokenizer_path: str) -> None:
    run_id, session, answers = play(client, greedy_engine.url, qwen_tokenizer_path)
    stats = client.get(f"/runs/{run_id}").json()["stats"]
    forks = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("gateway_forks:")}
    assert forks == {"edited": 1, "compacted": 1, "tools_changed": 1, "foreign_assistant": 3, "rewind": 1}, stats
    shapes = read_back(client, run_id, session, answers)
    assert shapes["packed_record"] == shapes["record"], "a packed read decodes to the JSON read's record"
    if os.environ.get("ROLLOUT_BUFFER_CAPTURE_FORKS") == "1":  # how the capture was made (before the change)
        CAPTURE.parent.mkdir(parents=True, exist_ok=True)
        CAPTURE.write_bytes(orjson.dumps(shapes, option=orjson.OPT_INDENT_2) + b"\n")
    captured = orjson.loads(CAPTURE.read_bytes())
    assert shapes["forks"] == captured["forks"] == 7
    assert len(shapes["record"]["turns"]) == len(captured["record"]["turns"]) == 11
    for key in ("answers", "record", "packed_record", "samples"):
        assert orjson.dumps(shapes[key]) == orjson.dumps(captured[key]), \
            f"{key} differs from the capture ({stored_digest(shapes[key])} != {stored_digest(captured[key])})"


def _session_bytes(redis_client: Any, run_id: str) -> int:
    """Bytes Redis holds for the run's session turns and their index (MEMORY USAGE, every field counted)."""
    from rollout_buffer.store import keys

    return sum(int(redis_client.memory_usage(key, samples=0) or 0)
               for key in (keys.session_nodes(run_id), keys.session_index(run_id)))


def _usage(redis_client: Any, run_id: str, session_id: str) -> tuple[int, int]:
    """(the session's byte count its cap is checked against, the bytes Redis holds of its turns' fields)."""
    from rollout_buffer.store import keys
    from rollout_buffer.store.sessions import usage_fields

    counted = int(redis_client.hget(keys.session_index(run_id), usage_fields(session_id)[1]) or 0)
    turns = int(redis_client.hget(keys.session_nodes(run_id), f"{session_id}|#") or 0)
    held = sum(int(redis_client.hstrlen(keys.session_nodes(run_id), f"{session_id}|{i}")) for i in range(turns))
    return counted, held


def test_forks_store_what_they_add(client: httpx.Client, server: Any, greedy_engine: Any,
                                   qwen_tokenizer_path: str) -> None:
    """N edits of a late message of a long history: Redis grows with the tokens each fork adds, not with N
    copies of the ~2,400-token prompt they share: while the session is open, once it is finished (its record),
    and in the session's byte count its `--max-session-mb` cap is checked against (0.2 MB here: counting each
    fork's whole prompt, as before, would have refused the 21st fork)."""
    import redis

    from rollout_buffer.store import keys
    from rollout_buffer.wire import packed_read
    from rollout_buffer.wire.packing import pack_record, unpack_record
    from rollout_buffer.wire.shared_prefix import SHARED_MAGIC, expand
    from tests.support.fork_script import ask_once
    from tests.support.gateway import assert_turns_are_engine_calls, engine_calls_of, new_session, start_external

    run_id = start_external(client, greedy_engine.url, qwen_tokenizer_path, repeats=1,
                            sampling_params={"max_tokens": 32, "temperature": 0.0})
    session = new_session(client, run_id, "edits")
    sid = session["session_id"]
    long_history = [{"role": "system", "content": "Answer in one short line, and check every sum twice. " * 200},
                    {"role": "user", "content": "What is 4 * 9?"}]
    first = ask_once(client, session, long_history)
    socket = (server.cwd / server.data_dir / "redis.sock").resolve() if server.cwd else \
        (server.data_dir / "redis.sock").resolve()
    with redis.Redis(unix_socket_path=str(socket)) as direct:
        before = _session_bytes(direct, run_id)
        prompt_tokens, added = [], []
        forks = 32
        for k in range(forks):
            edited = [*long_history, {"role": "assistant", "content": f"My answer, edited {k} times."},
                      {"role": "user", "content": "Are you sure?"}]
            answer = ask_once(client, session, edited)  # 200 each: under the session's 0.2 MB
            prompt_tokens.append(answer["usage"]["prompt_tokens"])
            added.append(answer["usage"]["completion_tokens"])
        grown = _session_bytes(direct, run_id) - before
        counted, held = _usage(direct, run_id, sid)
        finished = client.post(f"/sessions/{sid}/finish", json={"reward": 0.5},
                               headers={"Authorization": f"Bearer {session['api_key']}"})
        assert finished.status_code == 200, finished.text
        raw = direct.hget(keys.records(run_id), sid)
    stats = client.get(f"/runs/{run_id}").json()["stats"]
    assert stats["gateway_forks:edited"] == forks, stats
    prompt = min(prompt_tokens)
    assert prompt > 2000 and first["usage"]["prompt_tokens"] > 2000
    per_fork = grown / forks
    print(f"{forks} forks of a {prompt}-token prompt: {per_fork:.0f} B each in Redis")
    copy_of_prompt = 4 * prompt  # what each fork stored of its prompt's ids alone before (its messages' text too)
    # what a fork adds: ~15 prompt tokens after the edit, its output (ids 4 B + logprobs 8 B), its header
    # (its two new messages, the answer, the chain) and two index fields
    bound = 4 * 40 + 12 * max(added) + 2500
    assert per_fork < bound < copy_of_prompt / 3, (per_fork, bound, copy_of_prompt)
    # the cap counts what Redis holds of the turns, not each fork's whole prompt
    cap = 0.2 * 1024 * 1024
    whole_prompts = sum(4 * p + 12 * o for p, o in zip([first["usage"]["prompt_tokens"], *prompt_tokens],
                                                        [first["usage"]["completion_tokens"], *added]))
    assert counted == held < cap < whole_prompts, (counted, held, cap, whole_prompts)

    # the finished record in Redis: one copy of the prompt, then what each fork adds
    assert raw is not None and raw[:3] == SHARED_MAGIC
    as_before = expand(raw)
    assert as_before[:3] == b"RB1"
    record_per_fork = (len(raw) - 4 * first["usage"]["prompt_tokens"] - len(long_history[0]["content"])) / forks
    print(f"finished: {len(raw)} B stored ({len(as_before)} B as whole prompts), {record_per_fork:.0f} B per fork")
    assert record_per_fork < 4 * 40 + 12 * max(added) + 400 < copy_of_prompt / 10, record_per_fork
    assert len(as_before) - len(raw) > (forks - 1) * copy_of_prompt

    # read back whole (packed, then the same leased batch as JSON): the forks' records are their full prompts,
    # exactly as the engine saw them, and exactly what the whole-prompt form holds
    body = {"run_id": run_id, "wait_s": 10, "lease_s": 60, "batch_id": "fork-bytes"}
    packed = client.post("/get_rollout_data", json=body, headers={"Accept": packed_read.CONTENT_TYPE})
    [from_packed] = packed_read.decode(packed.content)["data"]["data"]
    [record] = client.post("/get_rollout_data", json=body).json()["data"]["data"]
    client.post("/ack", json={"run_id": run_id, "batch_ids": ["fork-bytes"]}).raise_for_status()
    turns = record["turns"]
    assert [len(t["prompt_ids"]) for t in turns[1:]] == prompt_tokens
    assert_turns_are_engine_calls(record, engine_calls_of(greedy_engine, sid))
    old = unpack_record(as_before)["turns"]
    for shown in (turns, from_packed["turns"]):
        assert [[list(t[k]) for k in ("prompt_ids", "output_ids", "output_logprobs")] for t in shown] == \
            [[t[k] for k in ("prompt_ids", "output_ids", "output_logprobs")] for t in old]
    assert len(pack_record({"turns": old})) > forks * copy_of_prompt
