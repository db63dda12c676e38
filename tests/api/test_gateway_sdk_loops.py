"""Two agent frameworks as they are, each in its own tool loop through the gateway: the OpenAI Agents SDK
(Responses API, streamed, a function tool) and pydantic-ai (Anthropic Messages, extended thinking, a tool).
Each record is token-exact against the engine's log and one branch: pydantic-ai replays a thinking block
only when it is signed, so the gateway's signatures are what keeps its loop from forking."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rollout_buffer.testing.engine import run_engine_in_thread
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from tests.support.gateway import (
    assert_one_branch,
    assert_turns_are_engine_calls,
    calculate,
    engine_calls_of,
    finish,
    new_session,
    read_group,
    start_external,
)
from tests.support.helpers import ServerProcess, ServerSpec

SERVER = ServerSpec(args=("--session-timeout-s", "60"))


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return calculate(f'{{"expression": "{expression}"}}')


@pytest.fixture(scope="module")
def thinking_engine() -> Iterator[Any]:
    with run_engine_in_thread(template="qwen3", seed=5) as engine:
        yield engine


def _run(server: ServerProcess, engine: Any, **extra: Any) -> tuple[httpx.Client, str]:
    client = httpx.Client(base_url=server.url, timeout=30)
    return client, start_external(client, engine.url, str(qwen_tokenizer_dir("qwen3")), repeats=1,
                                  reasoning_parser="qwen3", **extra)


def _trained_as_generated(client: httpx.Client, run_id: str, engine: Any, session: dict[str, Any]) -> None:
    finish(client, session, 1.0)
    [record] = read_group(client, run_id, 1)
    calls = engine_calls_of(engine, session["session_id"])
    assert len(calls) == 2  # the tool call, then the answer
    assert_turns_are_engine_calls(record, calls)
    assert_one_branch(record)
    assert "gateway_forks" not in client.get(f"/runs/{run_id}").json()["stats"]


def test_openai_agents_sdk_streamed_responses_loop(server: ServerProcess, thinking_engine: Any) -> None:
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would send traces to api.openai.com
    client, run_id = _run(server, thinking_engine)
    session = new_session(client, run_id, "agents-sdk")

    async def loop() -> Any:
        sdk = AsyncOpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
        model = OpenAIResponsesModel(model="policy", openai_client=sdk)
        agent = Agent(name="math", instructions="Use the calculator.", model=model,
                      tools=[function_tool(calculator)])
        result = Runner.run_streamed(agent, "What is 17 * 3?", max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds
        return result

    result = asyncio.run(loop())
    assert "\\boxed{51}" in str(result.final_output)
    _trained_as_generated(client, run_id, thinking_engine, session)


def test_pydantic_ai_anthropic_loop_with_thinking_makes_no_fork(server: ServerProcess,
                                                               thinking_engine: Any) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ThinkingPart
    from pydantic_ai.models.anthropic import AnthropicModel, AnthropicModelSettings
    from pydantic_ai.providers.anthropic import AnthropicProvider

    client, run_id = _run(server, thinking_engine)
    session = new_session(client, run_id, "pydantic-ai")
    provider = AnthropicProvider(base_url=session["anthropic_base_url"], api_key=session["api_key"])
    settings = AnthropicModelSettings(max_tokens=400,
                                      anthropic_thinking={"type": "enabled", "budget_tokens": 256})
    agent = Agent(AnthropicModel("policy", provider=provider), tools=[calculator], model_settings=settings)
    result = agent.run_sync("What is 17 * 3?")
    assert "\\boxed{51}" in result.output
    thinking = [part for message in result.all_messages() for part in getattr(message, "parts", [])
                if isinstance(part, ThinkingPart)]
    assert len(thinking) == 2 and all(part.signature and len(part.signature) >= 32 for part in thinking)
    _trained_as_generated(client, run_id, thinking_engine, session)
