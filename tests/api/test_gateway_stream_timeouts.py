"""A generation longer than the client's idle timeout completes when streamed: the SDKs' read timeout
(httpx's, the idle time between two reads) is 1.5 s, the generation takes about 4 s, and the tokens keep
the stream alive as they arrive; each turn is the engine's generation token for token."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai

from rollout_buffer.testing.engine import run_engine_in_thread
from tests.support.gateway import assert_turns_are_engine_calls, engine_calls_of, finish, new_session, read_group, \
    start_external
from tests.support.helpers import ServerProcess, ServerSpec

SERVER = ServerSpec(args=("--session-timeout-s", "60"))
TOKENS, DELAY_S, READ_S = 40, 0.1, 1.5  # a 4 s generation, a 1.5 s idle timeout


def test_long_streamed_generations_outlast_the_sdks_read_timeout(server: ServerProcess,
                                                                  qwen_tokenizer_path: str) -> None:
    with run_engine_in_thread(template="qwen2.5", seed=6, token_delay_s=DELAY_S) as engine, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, engine.url, qwen_tokenizer_path, repeats=1,
                                sampling_params={"max_tokens": TOKENS, "temperature": 1.0, "ignore_eos": True})
        session = new_session(client, run_id, "patient")
        timeout = httpx.Timeout(30, read=READ_S)
        sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0,
                            timeout=timeout)
        durations = []
        started = time.monotonic()
        chunks = list(sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 2 + 5?"}],
                                                  stream=True, stream_options={"include_usage": True}))
        durations.append(time.monotonic() - started)
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == TOKENS

        started = time.monotonic()
        events = list(sdk.responses.create(model="m", input="What is 3 + 5?", stream=True))
        durations.append(time.monotonic() - started)
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
        assert response.status == "incomplete" and response.usage.output_tokens == TOKENS

        claude = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"],
                                     max_retries=0, timeout=anthropic.Timeout(30, read=READ_S))
        started = time.monotonic()
        with claude.messages.stream(model="m", max_tokens=500,
                                    messages=[{"role": "user", "content": "What is 4 + 5?"}]) as stream:
            reply = stream.get_final_message()
        durations.append(time.monotonic() - started)
        assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == TOKENS

        assert all(d > 2 * READ_S for d in durations), durations  # each outlasted the idle timeout
        finish(client, session, 1.0)
        [record] = read_group(client, run_id, 1)
        calls = engine_calls_of(engine, session["session_id"])
        assert len(calls) == 3 and all(c["finish_reason"]["type"] == "length" for c in calls)
        assert_turns_are_engine_calls(record, calls)
