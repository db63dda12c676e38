"""SGLang's streamed `/generate` read by `post_stream` (against the test engine, which streams as SGLang does):
the same answer as the unstreamed call in both chunk modes, the text so far readable after every chunk,
and a cumulative stream whose chunks are longer than aiohttp's line limit (512 KiB) read all the same."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from rollout_buffer.runtime.engine_stream import post_stream
from rollout_buffer.testing.engine import run_engine_in_thread


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with run_engine_in_thread(template="qwen2.5", seed=3) as running:
        yield running


def _body(rid: str, tokens: int) -> dict[str, Any]:
    return {"input_ids": [9707, 11, 1879, 0], "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0}}


async def _streamed(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the merged answer, the text read after each chunk)."""
    texts: list[str] = []

    def on_text(read: Callable[[], str]) -> None:
        texts.append(read())

    async def abort() -> None:
        raise AssertionError("nothing to abort")

    async with aiohttp.ClientSession() as session:
        answer = await post_stream(session, f"{url}/generate", body, headers={}, timeout_s=60, on_text=on_text,
                                   abort=abort)
    return answer, texts


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_a_long_stream_is_the_unstreamed_answer(engine: Any, incremental: bool) -> None:
    engine.configure(incremental_streaming_output=incremental, stream_interval=1000, token_delay_s=0.0)
    async with aiohttp.ClientSession() as session, \
            session.post(f"{engine.url}/generate", json=_body("long", 16000)) as reply:
        plain = await reply.json()
    assert len(orjson.dumps(plain)) > 2 * 2**18  # the last cumulative chunk is longer than aiohttp's line limit
    answer, texts = await _streamed(engine.url, _body("long", 16000))
    assert answer["output_ids"] == plain["output_ids"] and len(answer["output_ids"]) == 16000
    assert answer["text"] == plain["text"]
    assert [e[:2] for e in answer["meta_info"]["output_token_logprobs"]] == \
        [e[:2] for e in plain["meta_info"]["output_token_logprobs"]]
    assert answer["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert len(texts) == 16000 // 1000  # a chunk every 1,000 tokens, each told, its text readable then
    assert all(plain["text"].startswith(text) for text in texts) and len(set(texts)) == len(texts)
    assert texts[-1] == plain["text"]
