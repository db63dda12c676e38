"""The write path's fast parser (simdjson, arrays without a Python object per token) stores exactly what the
pydantic model would, refuses exactly what it refuses, and steps aside for anything unusual."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from bench.records import realistic_record
from rollout_buffer.wire.packing import pack_record, unpack_record
from rollout_buffer.wire.record_parsing import parse_batch, parse_record
from rollout_buffer.wire.schema import BatchWriteRequest, TrajectoryRecord


def _slow_blob(body: bytes) -> bytes:
    return pack_record(TrajectoryRecord.model_validate_json(body).to_store())


def _fast_blob(body: bytes) -> bytes:
    return pack_record(parse_record(body).to_store())


def _record(**overrides: Any) -> dict[str, Any]:
    base = {"uid": "u1", "instance_id": 7, "messages": [{"role": "user", "content": "q"},
                                                          {"role": "assistant", "content": "a"}],
            "reward": 0.5, "extra_info": {"k": [1, 2]}, "custom": {"x": None},
            "turns": [{"prompt_ids": [1, 2, 3], "output_ids": [4, 5], "output_logprobs": [-0.5, -1e-9],
                       "finish_reason": "stop", "weight_version": 3, "ignored": True},
                      {"prompt_ids": [1, 2, 3, 4, 5, 9], "output_ids": [6], "output_logprobs": None}]}
    return {**base, **overrides}


@pytest.mark.parametrize("record", [
    realistic_record("i", "u", seed=3),
    _record(),
    _record(turns=None),
    {k: v for k, v in _record().items() if k != "turns"},
    _record(turns=[{"prompt_ids": [], "output_ids": [], "output_logprobs": []}]),
    _record(turns=[{"prompt_ids": [2**31 - 1], "output_ids": [0], "output_logprobs": [-1e308]}]),
    _record(turns=[{"prompt_ids": [1], "output_ids": [2], "output_logprobs": [0.1]}], status="truncated",
            epoch=2, run_id="r"),
    {**_record(), "\x00": None, "a\x00b": {"c\x00": "d\x00e"}},
], ids=["realistic", "two-turns", "null-turns", "no-turns", "empty-arrays", "extremes", "fields", "nul-in-keys"])
def test_fast_path_stores_the_same_bytes(record: dict[str, Any]) -> None:
    body = orjson.dumps(record)
    parsed = parse_record(body)
    assert parsed.array_turns is not None or not record.get("turns"), "ordinary records take the fast path"
    assert _fast_blob(body) == _slow_blob(body)
    assert unpack_record(_fast_blob(body)) == unpack_record(_slow_blob(body))


@pytest.mark.parametrize("turn, needle", [
    ({"prompt_ids": [1, -2], "output_ids": [3]}, "[0, 2^31)"),
    ({"prompt_ids": [1], "output_ids": [2**31]}, "[0, 2^31)"),
    ({"prompt_ids": [1], "output_ids": [3, 4], "output_logprobs": [-1.0]}, "1 values for 2 output_ids"),
    ({"prompt_ids": [1], "output_ids": [3], "output_logprobs": ["1e400"]}, "finite"),
    ({"prompt_ids": [1], "output_ids": ["3"]}, None),
    ({"prompt_ids": [1.5], "output_ids": [3]}, "integer"),
    ({"output_ids": [3]}, "prompt_ids"),
    ({"prompt_ids": [1], "output_ids": [3], "finish_reason": 5}, "finish_reason"),
])
def test_unusual_turns_get_the_models_own_answer(turn: dict[str, Any], needle: str | None) -> None:
    body = orjson.dumps(_record(turns=[turn])).replace(b'["1e400"]', b"[1e400]")  # JSON's number too big
    try:
        slow: Any = _slow_blob(body)
    except ValidationError as exc:
        slow = exc
    if isinstance(slow, bytes):  # the model accepts it (e.g. "3" as an id): so must the fast path
        assert needle is None and _fast_blob(body) == slow
        return
    with pytest.raises(ValidationError) as caught:
        parse_record(body)
    assert _comparable(caught.value) == _comparable(slow)
    assert needle is None or needle in str(caught.value)


def test_a_batch_is_parsed_the_same_way() -> None:
    records = [realistic_record(f"g{i // 2}", f"u{i}", seed=i) for i in range(4)]
    body = orjson.dumps({"run_id": "r1", "records": records})
    run_id, parsed = parse_batch(body)
    slow = BatchWriteRequest.model_validate_json(body)
    assert run_id == slow.run_id == "r1" and all(p.array_turns is not None for p in parsed)
    assert [pack_record(p.to_store()) for p in parsed] == [pack_record(r.to_store()) for r in slow.records]
    bad = orjson.dumps({"records": [records[0], {**records[1], "reward": "lots"}]})
    with pytest.raises(ValidationError) as caught:
        parse_batch(bad)
    assert _comparable(caught.value) == _errors(BatchWriteRequest, bad)


def _comparable(exc: ValidationError) -> list[Any]:
    return exc.errors(include_url=False, include_context=False)


def _errors(model: Any, body: bytes) -> list[Any]:
    try:
        model.model_validate_json(body)
    except ValidationError as exc:
        return _comparable(exc)
    raise AssertionError("expected a refusal")


def test_integers_beyond_64_bits_get_the_models_answer() -> None:
    """simdjson cannot hold them (found by the API fuzz test): the model decides, as for any odd body."""
    body = orjson.dumps(_record()).replace(b'"reward":', b'"big":-9223372036854775809,"reward":', 1)
    try:
        expected: Any = TrajectoryRecord.model_validate_json(body)
    except ValidationError as exc:
        expected = exc.errors()
    try:
        got: Any = parse_record(body).record
    except ValidationError as exc:
        got = exc.errors()
    assert got == expected


def test_not_json_is_refused_as_the_model_refuses_it() -> None:
    for body in (b"{", b"[1, 2]", b"", b'{"uid": "u", "instance_id": "i"'):
        with pytest.raises(ValidationError) as caught:
            parse_record(body)
        assert _comparable(caught.value) == _errors(TrajectoryRecord, body)
    assert parse_record(orjson.dumps(_record())).array_turns is not None, "the parser is usable after refusals"


_ids = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=40)
_logprob = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)


@st.composite
def _turns(draw: st.DrawFn) -> list[dict[str, Any]]:
    turns = []
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        output = draw(_ids)
        logprobs = draw(st.one_of(st.none(), st.lists(_logprob, min_size=len(output), max_size=len(output))))
        turns.append({"prompt_ids": draw(_ids), "output_ids": output, "output_logprobs": logprobs,
                      "finish_reason": draw(st.sampled_from([None, "stop", "length"])),
                      "weight_version": draw(st.one_of(st.none(), st.integers(0, 99), st.text(max_size=3)))})
    return turns


@settings(max_examples=200, deadline=None)
@given(turns=_turns(), reward=st.floats(-10, 10), uid=st.text(min_size=1, max_size=8))
def test_any_valid_record_stores_the_same_bytes_either_way(turns: list[dict[str, Any]], reward: float,
                                                           uid: str) -> None:
    body = orjson.dumps(_record(turns=turns, reward=reward, uid=uid))
    assert _fast_blob(body) == _slow_blob(body)


def test_turns_with_version_spans_take_the_models_path_and_keep_them() -> None:
    turn = {"prompt_ids": [1, 2], "output_ids": [3, 4, 5], "output_logprobs": [-0.1, -0.2, -0.3],
            "weight_version": 4, "version_spans": [[4, 2], [5, 1]]}
    body = orjson.dumps(_record(turns=[turn], policy_version=4, generation=1))
    parsed = parse_record(body)
    assert parsed.array_turns is None, "per-token versions go through the model"
    assert _fast_blob(body) == _slow_blob(body)
    stored = unpack_record(_fast_blob(body))
    assert stored["policy_version"] == 4 and stored["generation"] == 1
