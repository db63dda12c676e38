"""The rollout hot path's lean parts, each checked against what it replaces: piecewise and word-cached
encoding against the tokenizer, engine-call failure classification, group-committed Redis script calls,
retries (tenacity after a bare first attempt), and the history guard's incremental copies."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from rollout_buffer.runtime.engine_http import (
    EngineTimeout,
    RetryPolicy,
    TransientEngineError,
    backoff_s,
    call_with_retries,
    close_session,
    new_session,
    post_once,
)
from rollout_buffer.runtime.history import HistoryGuard
from rollout_buffer.runtime.jobqueue import JobQueue
from rollout_buffer.runtime.prompt_tokens import AsciiWords, PieceEncoder, piece_encoder
from rollout_buffer.store.batching import Coalescer
from rollout_buffer.store.store import Store
from rollout_buffer.tasks.builtin.calculator_generator import TOOLS
from rollout_buffer.tasks.contract import EngineError, HistoryRewriteError
from rollout_buffer.testing.engine import running_engine
from rollout_buffer.testing.tokenizer import TEMPLATES, load_qwen_tokenizer

# --------------------------------------------------------------------------- encoding


def _conversations() -> list[list[dict[str, Any]]]:
    call = {"id": "call_0_0", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "12 * (3 + 4)"}'}}
    return [
        [{"role": "user", "content": "What is 12 * (3 + 4)?"}],
        [{"role": "system", "content": "Be brief.  Use tools.\n\n"},
         {"role": "user", "content": "Héllo, 你好 — 2+2?"}],
        [{"role": "user", "content": "x's y'LL z'd"}, {"role": "assistant", "content": "ok", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_0_0", "content": "84"},
         {"role": "user", "content": "  and\tthen\r\n?"}],
    ]


@pytest.mark.parametrize("template", TEMPLATES)
def test_piece_encoder_gives_the_tokenizers_ids(template: str) -> None:
    tokenizer = load_qwen_tokenizer(template)
    encoder = piece_encoder(tokenizer)
    assert encoder.piecewise and AsciiWords.for_backend(tokenizer.backend_tokenizer) is not None
    texts = [tokenizer.apply_chat_template(c, tools=tools, tokenize=False, add_generation_prompt=True)
             for c in _conversations() for tools in (TOOLS, None)]
    rng = random.Random(5)
    added = [str(t.content) for t in tokenizer.added_tokens_decoder.values()]
    ascii_alphabet = "aZ9 \n\t\r'sSlLdD.,!?-_(){}<>|:;\"#$%&*+/=@\\^`~"
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(1, 8)):
            roll = rng.random()
            if roll < 0.2:
                parts.append(rng.choice(added))
            elif roll < 0.35:
                parts.append(rng.choice(["é", "你好", "\u00a0", "\x0b", "\x1c", "😀", "\u2063"]))
            else:
                parts.append("".join(rng.choice(ascii_alphabet) for _ in range(rng.randint(1, 40))))
        texts.append("".join(parts))
    for text in texts + texts:  # the second pass is served from the caches
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False), repr(text)
    assert encoder.hits > 0


class _FakeBackend:
    """A backend with another pre-tokenizer: the ASCII word path must not claim it."""

    pre_tokenizer = "Whitespace()"
    normalizer = None
    model = None

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return {}


class _PlainTokenizer:
    """No fast backend at all: encoding goes to `tokenizer.encode`."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        return [ord(c) for c in text]


def test_fast_paths_are_refused_where_they_are_not_exact() -> None:
    assert AsciiWords.for_backend(_FakeBackend()) is None
    plain = _PlainTokenizer()
    encoder = PieceEncoder(plain)
    assert not encoder.piecewise and encoder.encode("ab") == [97, 98] and plain.calls == 1


# --------------------------------------------------------------------------- lean HTTP client

Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]


class ScriptedServer:
    """A raw TCP server: `answer(request_bytes, writer)` writes whatever bytes a test wants; returning False
    closes the connection."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/generate"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.answer(request, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


async def test_post_once_classifies_failures() -> None:
    session = new_session()
    try:
        with pytest.raises(TransientEngineError, match="talking to"):
            await post_once(session, "http://127.0.0.1:9/generate", {"input_ids": [1]}, headers={}, timeout_s=2)
        async with running_engine(seed=1) as engine:
            engine.configure(hang_next=1)
            with pytest.raises(EngineTimeout):
                await post_once(session, engine.url + "/generate", {"input_ids": [1, 2]}, headers={}, timeout_s=0.3)
            engine.configure(fail_next=1)
            with pytest.raises(TransientEngineError, match="HTTP 500"):
                await post_once(session, engine.url + "/generate", {"input_ids": [1, 2]}, headers={}, timeout_s=5)
            with pytest.raises(EngineError, match="HTTP 400"):
                await post_once(session, engine.url + "/generate", {"input_ids": [-1]}, headers={}, timeout_s=5)
            answer = await post_once(session, engine.url + "/generate", {"input_ids": [1, 2], "rid": "x"},
                                     headers={}, timeout_s=5)
            assert answer["output_ids"] and answer["meta_info"]["finish_reason"]
    finally:
        await close_session(session)


# --------------------------------------------------------------------------- retries


async def test_retries_back_off_exponentially_and_give_up_with_the_last_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []

    async def fake_sleep(delay: float) -> None:
        sleeps.append(delay)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    policy = RetryPolicy(retries=3, backoff_s=0.5, max_backoff_s=1.5)
    seen: list[BaseException] = []

    async def always_failing(number: int) -> None:
        raise TransientEngineError(f"boom {number}")

    with pytest.raises(EngineError, match="boom 4 \\(gave up after 4 attempts\\)") as caught:
        await call_with_retries(always_failing, policy, on_retry=seen.append)
    assert not isinstance(caught.value, TransientEngineError)
    assert [str(e) for e in seen] == ["boom 1", "boom 2", "boom 3"]
    assert [round(s - base, 6) >= 0 and s - base <= 0.5 for s, base in zip(sleeps, (0.5, 1.0, 1.5), strict=True)] \
        == [True, True, True], sleeps
    assert all(0 <= backoff_s(policy, 10) - 1.5 <= 0.5 for _ in range(20)), "capped at max_backoff_s"

    calls: list[int] = []

    async def fails_once(number: int) -> str:
        calls.append(number)
        if number == 1:
            raise TransientEngineError("once")
        return "ok"

    assert await call_with_retries(fails_once, policy) == "ok" and calls == [1, 2]

    async def final(number: int) -> None:
        calls.append(number)
        raise EngineError("4xx")

    calls.clear()
    with pytest.raises(EngineError, match="^4xx$"):
        await call_with_retries(final, policy)
    assert calls == [1], "a final error is not retried"


# --------------------------------------------------------------------------- batching


async def test_coalescer_sends_concurrent_calls_together_and_keeps_failures_apart() -> None:
    batches: list[list[int]] = []

    async def run(items: list[int]) -> list[int | BaseException]:
        batches.append(items)
        await asyncio.sleep(0.01)
        return [ValueError(f"bad {i}") if i == 3 else i * 10 for i in items]

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=4)
    results = await asyncio.gather(*(coalescer.submit(i) for i in range(10)), return_exceptions=True)
    assert [r if not isinstance(r, BaseException) else str(r) for r in results] == \
        [0, 10, 20, "bad 3", 40, 50, 60, 70, 80, 90]
    assert [len(b) for b in batches] == [4, 4, 2] and coalescer.batches == 3
    first = asyncio.ensure_future(coalescer.submit(1))  # an idle coalescer sends at once
    await asyncio.sleep(0)
    late = [asyncio.ensure_future(coalescer.submit(i)) for i in (5, 6)]  # these wait for the next round trip
    assert await first == 10 and await asyncio.gather(*late) == [50, 60]
    assert [len(b) for b in batches[3:]] == [1, 2]

    async def broken(items: list[int]) -> list[int]:
        raise ConnectionError("redis is gone")

    failing: Coalescer[int, int] = Coalescer(broken)
    results = await asyncio.gather(*(failing.submit(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)



async def test_task_scripts_share_round_trips_and_survive_a_script_flush(redis_store: Store) -> None:
    run_id = "hot-run"
    await redis_store.create_run(run_id, {}, group_size=1, num_epoch=1, task_type="math")
    queue = JobQueue(redis_store.redis, run_id)
    samples = [{"instance_id": f"s{i}", "prompt": str(i)} for i in range(40)]
    await queue.enqueue(samples, num_epoch=1, repeats=1, excluded=set())
    tasks = await queue.read_new("c1", 100, 10)
    await redis_store.redis.script_flush()  # e.g. a Redis restart without persistence of scripts
    claims = await asyncio.gather(*(queue.start(task) for task in tasks))
    assert all(c.proceed and c.attempt == 1 for c in claims)
    assert [c.sample for c in claims] == samples
    assert queue._scripts.batches < len(tasks) / 4, "concurrent starts go out together"
    finals = await asyncio.gather(*(queue.finish(task, "done", {"engine_calls": 3}) for task in tasks))
    assert finals == ["running"] * len(tasks)
    stats = await redis_store.stats(run_id)
    assert (stats["tasks_done"], stats["engine_calls"]) == (40, 120)
    assert (await redis_store.run_meta(run_id))["status"] == "finished"


# --------------------------------------------------------------------------- history


def test_history_guard_copies_only_new_messages_and_still_sees_every_rewrite() -> None:
    guard = HistoryGuard()
    user = {"role": "user", "content": "q"}
    messages = [user]
    guard.new_messages(messages, TOOLS)
    user["content"] = "edited while the engine call ran"  # after the check, before the record
    guard.record(messages, TOOLS, {"role": "assistant", "content": "a"})
    with pytest.raises(HistoryRewriteError, match="messages\\[0\\]"):
        guard.new_messages([*messages, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}],
                           TOOLS)
    guard = HistoryGuard()
    turn: list[dict[str, Any]] = [{"role": "user", "content": "q"}]
    for i in range(3):
        guard.new_messages(turn, TOOLS)
        answer = {"role": "assistant", "content": f"a{i}"}
        guard.record(turn, TOOLS, answer)
        turn = [*turn, answer, {"role": "user", "content": f"q{i}"}]
    assert guard.conversation() == turn[:-1]
    assert guard.conversation() is not guard.seen and guard.seen[0] is not turn[0]
