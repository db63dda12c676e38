"""Hypothesis tests of the packed batch decoder (`/buffer/write_packed`'s body): random bytes, truncated
and corrupted valid batches, and structurally odd headers never raise anything but `PackedBatchError`, and
whatever it accepts packs and unpacks cleanly (so nothing poisonous is stored for a later read)."""

from __future__ import annotations

import struct
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_buffer.wire.packed_batch import PackedBatchError, decode_batch, encode_batch, stamped_blob
from rollout_buffer.wire.packing import MAGIC, unpack_record

SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def record(i: int, turns: int = 2) -> dict[str, Any]:
    prompt = [1, 2, 3 + i]
    made = []
    for t in range(turns):
        output = [10 + t, 11 + t]
        made.append({"prompt_ids": prompt, "output_ids": output, "output_logprobs": [-0.5, -0.25],
                     "finish_reason": "stop", "weight_version": "v1"})
        prompt = prompt + output + [7]
    return {"uid": f"u{i}", "instance_id": f"i{i}", "messages": [{"role": "user", "content": "q"}],
            "reward": 1.0, "extra_info": {}, "turns": made}


VALID = encode_batch([record(0), record(1, turns=0), record(2, turns=3)])


def accepted_cleanly(body: bytes) -> None:
    """Decode; if accepted, what would be stored must read back."""
    try:
        items = decode_batch(body)
    except PackedBatchError:
        return
    for item in items:
        stored = unpack_record(stamped_blob(item, "run"))
        assert stored["uid"] == item.fields["uid"] and stored["run_id"] == "run"


@SETTINGS
@given(st.binary(max_size=2048))
def test_random_bytes_are_refused_or_stored_cleanly(body: bytes) -> None:
    accepted_cleanly(body)


@SETTINGS
@given(st.binary(max_size=256))
def test_random_bytes_behind_a_plausible_prefix(tail: bytes) -> None:
    blob = MAGIC + struct.pack("<I", len(tail)) + tail
    accepted_cleanly(struct.pack("<I", len(blob)) + blob)


def _boundaries(body: bytes) -> list[int]:
    """Offsets where a record of `body` ends (a batch cut there is a whole, smaller batch)."""
    ends, offset = [], 0
    while offset < len(body):
        offset += 4 + struct.unpack_from("<I", body, offset)[0]
        ends.append(offset)
    return ends


@SETTINGS
@given(st.integers(min_value=0, max_value=len(VALID) - 1))
def test_a_truncated_batch_is_refused_whole(cut: int) -> None:
    """Cut inside a record: refused. Cut exactly after a record: the records before the cut, whole (the
    format has no count; such a body is a well-formed smaller batch)."""
    ends = _boundaries(VALID)
    if cut in ends:
        assert len(decode_batch(VALID[:cut])) == ends.index(cut) + 1
        return
    with pytest.raises(PackedBatchError):
        decode_batch(VALID[:cut])


@SETTINGS
@given(st.integers(min_value=0, max_value=len(VALID) - 1), st.integers(min_value=1, max_value=255))
def test_corrupted_bytes_are_refused_or_stored_cleanly(position: int, flip: int) -> None:
    body = bytearray(VALID)
    body[position] ^= flip
    accepted_cleanly(bytes(body))


json_values = st.recursive(st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64)
                           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                      max_size=3), max_leaves=8)
turn_meta = st.fixed_dictionaries({"ext": json_values | st.booleans(), "p": json_values | st.integers(0, 4),
                                   "o": json_values | st.integers(0, 4), "lp": st.sampled_from([0, 4, 8]) | json_values,
                                   "finish_reason": json_values, "weight_version": json_values})


@SETTINGS
@given(st.lists(turn_meta, max_size=3) | json_values, st.binary(max_size=96), json_values)
def test_odd_headers_are_refused_or_stored_cleanly(turns: Any, arrays: bytes, extra: Any) -> None:
    header = {"uid": "u", "instance_id": "i", "messages": [], "reward": 1.0, "extra_info": {}, "_turns": turns,
              "extra": extra}
    try:
        head = orjson.dumps(header)
    except orjson.JSONEncodeError:
        return  # not expressible as JSON: no client can send it
    blob = MAGIC + struct.pack("<I", len(head)) + head + arrays
    accepted_cleanly(struct.pack("<I", len(blob)) + blob)


def test_a_valid_batch_decodes_whole() -> None:
    items = decode_batch(VALID)
    assert [i.fields["uid"] for i in items] == ["u0", "u1", "u2"]
    assert unpack_record(stamped_blob(items[2], "r"))["turns"][2]["prompt_ids"] == record(2, 3)["turns"][2]["prompt_ids"]
    with pytest.raises(PackedBatchError, match="empty"):
        decode_batch(b"")
