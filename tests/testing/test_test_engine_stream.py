"""The test engine's streamed `/generate`, as SGLang streams it: server-sent `data:` chunks, cumulative by
default and incremental when configured, every chunk's logprobs the whole output so far, the last one the
same answer as without streaming; tokens paced by `token_delay_s`; `/abort_request` cuts a stream and a
client that disconnects stops the generation, logged as aborted."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rollout_buffer.testing.engine import run_engine_in_thread


@pytest.fixture
def engine() -> Iterator[Any]:
    with run_engine_in_thread(template="qwen2.5", seed=3) as running:
        yield running


def _body(rid: str, **params: Any) -> dict[str, Any]:
    return {"input_ids": [9707, 11, 1879, 0], "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, **params}}


def _events(response: httpx.Response) -> Iterator[Any]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def _stream(url: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
        return list(_events(response))


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_a_stream_is_the_same_answer_chunk_by_chunk(engine: Any, incremental: bool) -> None:
    plain = httpx.post(f"{engine.url}/generate", json=_body("r1"), timeout=30).json()
    engine.configure(incremental_streaming_output=incremental, stream_interval=2)
    events = _stream(engine.url, _body("r1"))
    assert events[-1] == "[DONE]" and len(events) > 3
    chunks = events[:-1]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    if incremental:
        ids = [t for c in chunks for t in c["output_ids"]]
        assert all(len(c["output_ids"]) == 2 for c in chunks[:-1])
    else:
        ids = chunks[-1]["output_ids"]
        for before, after in zip(chunks, chunks[1:]):
            assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert ids == plain["output_ids"]
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]
    for c in chunks:  # logprobs: always everything so far
        assert len(c["meta_info"]["output_token_logprobs"]) == c["meta_info"]["completion_tokens"]


def test_tokens_arrive_paced_and_an_abort_cuts_the_stream(engine: Any) -> None:
    engine.configure(token_delay_s=0.05, latency_s=0.2)
    started = time.monotonic()
    arrivals = []
    aborter = threading.Timer(0.6, lambda: httpx.post(f"{engine.url}/abort_request", json={"rid": "slow"}, timeout=30))
    aborter.start()
    with httpx.stream("POST", f"{engine.url}/generate", json={**_body("slow"), "stream": True},
                      timeout=30) as response:
        for event in _events(response):
            arrivals.append((time.monotonic() - started, event))
    aborter.join()
    first, last = arrivals[0][0], arrivals[-2][0]
    assert 0.2 <= first < 1.5 and last - first >= 0.2, arrivals  # the first token after the latency, then paced
    final = arrivals[-2][1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(final["output_ids"]) < 40
    [call] = engine.call_log()
    assert call["finish_reason"]["type"] == "abort" and call["output_ids"] == final["output_ids"]


def test_a_client_that_disconnects_stops_the_generation(engine: Any) -> None:
    engine.configure(token_delay_s=0.05)
    with httpx.stream("POST", f"{engine.url}/generate", json={**_body("gone"), "stream": True},
                      timeout=30) as response:
        next(_events(response))
    deadline = time.monotonic() + 5
    while not engine.call_log() and time.monotonic() < deadline:
        time.sleep(0.02)
    [call] = engine.call_log()
    assert call["rid"] == "gone" and call["finish_reason"] == {"type": "abort", "message": "the client disconnected"}
    assert 0 < len(call["output_ids"]) < 10
