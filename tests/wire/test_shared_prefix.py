"""The stored form with shared prefixes (`wire.shared_prefix`, RB2): a record whose turns start over from
earlier turns keeps one copy of what they share, and `expand` gives back the RB1 blob `pack_record` writes,
byte for byte; an RB1 blob (every record stored before) reads as it is; a broken RB2 blob is refused."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_buffer.wire.packed_read import stored_record
from rollout_buffer.wire.packing import PackingError, pack_record, unpack_record
from rollout_buffer.wire.shared_prefix import MIN_SHARED_TOKENS, SHARED_MAGIC, expand, pack_shared


def _turn(prompt: list[int], output: list[int], rng: np.random.Generator, *, wide: bool = False,
          replay: bool = False) -> dict[str, Any]:
    logprobs = (-rng.random(len(output))).astype(np.float32).astype(float).tolist()
    if wide and logprobs:
        logprobs[0] = -0.1  # not a float32 value: this turn's logprobs are stored as float64
    turn: dict[str, Any] = {"prompt_ids": prompt, "output_ids": output, "output_logprobs": logprobs,
                            "finish_reason": "stop", "weight_version": "3"}
    if replay:
        turn["routed_experts"] = rng.integers(0, 64, size=2 * len(output)).tolist()
        turn["routed_experts_start_len"] = 1
        turn["top_p_token_ids"] = rng.integers(0, 1000, size=len(output)).tolist()
        turn["top_p_token_offsets"] = list(range(len(output) + 1))
    return turn


def forked_session(rng: np.random.Generator, forks: int, prompt_len: int) -> tuple[dict[str, Any], list[int | None]]:
    """A session as the gateway finishes it: a first turn, a turn that goes on from it, then `forks` edits of
    the second turn's history (each a new prompt sharing a long prefix with turn 1), some going on a turn."""
    system = rng.integers(0, 150_000, size=prompt_len).tolist()
    out0 = rng.integers(0, 150_000, size=12).tolist()
    p1 = [*system, *out0, 7, 8, 9]
    out1 = rng.integers(0, 150_000, size=10).tolist()
    turns = [_turn(system, out0, rng), _turn(p1, out1, rng, replay=True)]
    sources: list[int | None] = [None, 0]
    for k in range(forks):
        edit = rng.integers(0, 150_000, size=1 + k % 5).tolist()
        prompt = [*p1, *out1[:3], *edit]
        out = rng.integers(0, 150_000, size=1 + k % 7).tolist()
        turns.append(_turn(prompt, out, rng, wide=k % 3 == 0, replay=k % 4 == 0))
        sources.append(1)
        if k % 2:  # the client goes on from the fork: its next prompt extends it (RB1's `ext`)
            turns.append(_turn([*prompt, *out, 5, 6], [11, 12], rng))
            sources.append(len(turns) - 2)
    record = {"uid": "u", "instance_id": "i", "messages": [{"role": "user", "content": "x"}], "reward": 1.0,
              "extra_info": {"k": 1}, "status": "completed", "run_id": "r", "turns": turns}
    return record, sources


def test_forks_store_what_they_add_and_expand_to_rb1() -> None:
    rng = np.random.default_rng(33)
    record, sources = forked_session(rng, forks=40, prompt_len=3000)
    full = pack_record(record)
    shared = pack_shared(record, sources)
    assert shared[:3] == SHARED_MAGIC and full[:3] == b"RB1"
    assert expand(shared) == full  # byte for byte what was stored before
    assert unpack_record(expand(shared)) == unpack_record(full)
    # 40 forks of a ~3,000-token prompt: RB1 holds 41 copies of it (turn 0's, then one per fork; turn 1 is a
    # tail of turn 0), the shared form one, plus each fork's own few ids, logprobs and metadata
    prompt_bytes = 4 * 3000
    assert len(full) > 41 * prompt_bytes
    assert len(full) - len(shared) >= 40 * prompt_bytes
    assert len(shared) < prompt_bytes + 40 * 400, (len(shared), len(full))
    # the read path hands out exactly what it handed out for the RB1 blob
    a, stored_a = stored_record(shared)
    b, stored_b = stored_record(full)
    assert stored_a.blob == stored_b.blob == full and stored_a.offset == stored_b.offset
    for x, y in zip(a["turns"], b["turns"]):
        assert x.keys() == y.keys()
        for key in x:
            assert np.array_equal(np.asarray(x[key]), np.asarray(y[key])) if isinstance(x[key], np.ndarray) \
                else x[key] == y[key], key


def test_without_a_share_the_blob_is_rb1() -> None:
    rng = np.random.default_rng(1)
    record, sources = forked_session(rng, forks=3, prompt_len=100)
    assert pack_shared(record, [None] * len(sources)) == pack_record(record)
    # a hint that shares less than MIN_SHARED_TOKENS stores the whole prompt (RB1)
    short = {**record, "turns": [_turn(list(range(MIN_SHARED_TOKENS - 1)), [1], rng),
                                 _turn([*range(MIN_SHARED_TOKENS - 1), 99], [2], rng)]}
    assert pack_shared(short, [None, 0]) == pack_record(short)
    # a wrong hint (nothing shared) costs nothing either
    other = {**record, "turns": [_turn(list(range(50)), [1], rng), _turn(list(range(100, 150)), [2], rng)]}
    assert pack_shared(other, [None, 0]) == pack_record(other)
    assert expand(pack_record(record)) == pack_record(record)  # RB1: read as it always was


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_session_shape_expands_to_rb1(data: st.DataObject) -> None:
    """Random turn trees: every turn either goes on from the one before it, starts over from any earlier turn's
    prompt + output with its own tail, or starts fresh; hints may be right or wrong."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    turns: list[dict[str, Any]] = []
    sources: list[int | None] = []
    for i in range(data.draw(st.integers(1, 12))):
        kind = data.draw(st.sampled_from(["fresh", "extend", "fork"])) if i else "fresh"
        tail = rng.integers(0, 5000, size=data.draw(st.integers(0, 40))).tolist()
        if kind == "fresh":
            prompt, source = tail or [1], data.draw(st.none() | st.integers(0, max(i - 1, 0)))
        elif kind == "extend":
            prev = turns[-1]
            prompt, source = [*prev["prompt_ids"], *prev["output_ids"], *tail], i - 1
        else:
            source = data.draw(st.integers(0, i - 1))
            history = [*turns[source]["prompt_ids"], *turns[source]["output_ids"]]
            prompt = [*history[:data.draw(st.integers(0, len(history)))], *tail] or [2]
        output = rng.integers(0, 5000, size=data.draw(st.integers(0, 6))).tolist()
        turns.append(_turn(prompt, output, rng, wide=data.draw(st.booleans()), replay=data.draw(st.booleans())))
        sources.append(source)
    record = {"uid": "u", "instance_id": "i", "messages": [], "reward": 0.0, "extra_info": {}, "turns": turns}
    assert expand(pack_shared(record, sources)) == pack_record(record)


def _parts(blob: bytes) -> tuple[bytes, bytes, bytes]:
    (n,) = struct.unpack_from("<I", blob, 3)
    head = blob[7:7 + n]
    (m,) = struct.unpack_from("<I", blob, 7 + n)
    return head, blob[11 + n:11 + n + m], blob[11 + n + m:]


def _with_table(blob: bytes, table: Any) -> bytes:
    head, _, arrays = _parts(blob)
    raw = orjson.dumps(table)
    return b"".join([SHARED_MAGIC, struct.pack("<I", len(head)), head, struct.pack("<I", len(raw)), raw, arrays])


def test_a_broken_shared_blob_is_refused() -> None:
    rng = np.random.default_rng(5)
    record, sources = forked_session(rng, forks=2, prompt_len=200)
    blob = pack_shared(record, sources)
    _, table, _ = _parts(blob)
    shares = orjson.loads(table)
    assert [s[:2] for s in shares] == [[2, 1], [3, 1]]
    cases = {
        "truncated": blob[:-3],
        "trailing": blob + b"\0\0\0\0",
        "source not earlier": _with_table(blob, [[2, 2, shares[0][2]], shares[1]]),
        "too long a share": _with_table(blob, [[2, 1, 10**6], shares[1]]),
        "not a table": _with_table(blob, {"a": 1}),
        "a turn twice": _with_table(blob, [shares[0], shares[0]]),
        "a share on an extending turn": _with_table(blob, [*shares, [4, 1, 20]]),
        "short header": SHARED_MAGIC + b"\1",
        "no turns": pack_shared({**record, "turns": None}, []).replace(b"RB1", SHARED_MAGIC, 1),
    }
    for what, broken in cases.items():
        with pytest.raises(PackingError):
            expand(broken)
            pytest.fail(what)
