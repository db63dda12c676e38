"""Gateway records carry what slime's trainer reads, as runtime records do: each turn keeps its engine
calls' meta_info (the engine's weight_version, prefix cache and speculative counts) and, when the run
asks as slime does, routed experts and top-p replay, so Samples built from a session's record pass the
same checks (`tests/support/slime_fields.py`); with `SLIME_DIR`, on slime's own `Sample` too. The agent's
time between its turns (a tool) is the record's `non_generation_time`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from slime_adapter.reading.buffer_client import ack_batches, fetch_rollout_data
from slime_adapter.samples.build import build_group_samples
from tests.support.gateway import finish, new_session, start_external
from tests.support.helpers import ServerSpec
from tests.support.slime_fields import check_sample_fields
from tests.support.torch_standin import real_slime

SERVER = ServerSpec(args=("--session-timeout-s", "60"))
MOE = (2, 2, 8)
REPLAY = {"max_tokens": 128, "temperature": 1.0, "top_p": 0.9, "custom_params": {"return_top_p_token_ids": True},
          "return_routed_experts": True}
TOOL_S = 0.3  # the agent's "tool" between its two turns


@pytest.fixture()
def replay_engine(rollout_engine: Any) -> Iterator[Any]:
    rollout_engine.configure(weight_version="v9", spec_draft_tokens=2, routed_experts_from_cache=True,
                             moe_layers=MOE[0], moe_topk=MOE[1], moe_experts=MOE[2])
    yield rollout_engine
    rollout_engine.configure(weight_version="default", spec_draft_tokens=0, routed_experts_from_cache=False)


@pytest.fixture(params=["contract", "slime"])
def sample_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The adapter's own Sample (always), or slime's real one (with `SLIME_DIR`)."""
    if request.param == "contract":
        yield None
    else:
        yield from real_slime(monkeypatch)


def test_gateway_records_fill_every_field_slime_reads(client: httpx.Client, replay_engine: Any,
                                                      qwen_tokenizer_path: str, sample_kind: Any) -> None:
    run_id = start_external(client, replay_engine.url, qwen_tokenizer_path, repeats=2, sampling_params=REPLAY)
    elapsed: list[float] = []
    for reward in (1.0, 0.0):
        session = new_session(client, run_id, "g-1")
        sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
        messages: list[dict[str, Any]] = []
        began = time.monotonic()
        for question in ("What is 6 * 7?", "And 6 * 8?"):
            if messages:
                time.sleep(TOOL_S)  # at least TOOL_S on the monotonic clock
            messages.append({"role": "user", "content": question})
            answer = sdk.chat.completions.create(model="policy", messages=messages).choices[0].message
            messages.append({"role": "assistant", "content": answer.content or ""})
        elapsed.append(time.monotonic() - began)
        finish(client, session, reward)
    records, meta, _ = asyncio.run(fetch_rollout_data(str(client.base_url), run_id=run_id, lease_s=60, wait_s=10,
                                                      read_format="packed"))
    asyncio.run(ack_batches(str(client.base_url), [meta["batch_id"]], run_id=run_id))
    assert len(records) == 2
    samples, stats = build_group_samples(records, lambda: pytest.fail("token path"), moe_shape=MOE[:2],
                                         first_rollout_id=0)
    assert stats.forks == 0 and len(samples) == 2
    for sample, record in zip(samples, records):
        if sample_kind is not None:
            assert type(sample) is sample_kind.Sample
            sample._validate_response_metadata_lengths()  # slime's own checks
        assert sample.session_id == record["uid"] == record["extra_info"]["session_id"]
        check_sample_fields(sample, engine_version="v9", calls=2, spec_draft=2, moe=MOE,
                            vocab=replay_engine.codec.vocab_size, min_tool_s=TOOL_S, stamped=False)
        assert record["non_generation_time"] == sample.non_generation_time <= max(elapsed), \
            "only the time between turns, not the time the agent waited on the model"
    assert [s.rollout_id for s in samples] == [0, 1]


def _node(index: int, started_at: float, created_at: float) -> Any:
    import numpy as np

    from rollout_buffer.store.session_turns import Node

    return Node(index=index, parent=index - 1, new_messages=[], message={"role": "assistant", "content": ""},
                prompt_ids=np.zeros(1, np.int32), output_ids=np.zeros(1, np.int32),
                output_logprobs=np.zeros(1), finish_reason="stop", started_at=started_at, created_at=created_at)


def test_non_generation_time_is_the_time_no_turn_was_being_answered() -> None:
    from rollout_buffer.api.gateway.records import outside_engine_time
    from rollout_buffer.store.session_turns import Node

    assert outside_engine_time([_node(0, 10.0, 12.0), _node(1, 12.5, 13.0), _node(2, 15.0, 16.0)]) == 2.5
    # turns answered side by side (an agent's parallel calls) count once; out of order as stored
    assert outside_engine_time([_node(1, 11.0, 14.0), _node(0, 10.0, 12.0), _node(2, 14.25, 15.0)]) == 0.25
    assert outside_engine_time([_node(0, 0.0, 12.0), _node(1, 12.5, 13.0)]) is None, "a turn stored without it"
    assert outside_engine_time([]) is None
    again = Node.unpack(_node(3, 20.5, 21.0).pack())
    assert (again.started_at, again.created_at) == (20.5, 21.0), "kept with the stored turn"
