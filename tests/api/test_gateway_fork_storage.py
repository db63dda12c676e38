"""What a fork stores is what it adds: a session whose client edits its history keeps one copy of the shared
prefix, and everything read back (answers, the finished record by JSON and packed reads, the adapter's
samples) is byte for byte what it was when every fork stored its whole prompt."""

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

SERVER = ServerSpec(args=("--session-timeout-s", "120"))
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
