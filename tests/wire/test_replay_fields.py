"""A turn's engine-call meta and replay arrays (routed experts, top-p ids and offsets) through the wire:
validated by the schema, packed per token beside ids and logprobs, read back as lists or arrays."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from rollout_buffer.wire.packing import check_arrays, pack_record, read_header, unpack_record, unpack_record_arrays
from rollout_buffer.wire.schema import TrajectoryRecord

TURN = {"prompt_ids": [1, 2, 3], "output_ids": [4, 5], "output_logprobs": [-0.5, -0.25], "finish_reason": "stop",
        "weight_version": 0, "calls": [{"weight_version": "v7", "cached_tokens": 1, "prompt_tokens": 3}],
        "routed_experts": list(range(16)), "routed_experts_start_len": 0,
        "top_p_token_ids": [4, 9, 5], "top_p_token_offsets": [0, 2, 3]}
NEXT = {"prompt_ids": [1, 2, 3, 4, 5, 6], "output_ids": [7], "output_logprobs": [-1.0], "finish_reason": "stop",
        "weight_version": 1}


def record(*turns: dict) -> dict:
    return {"uid": "u", "instance_id": "1", "messages": [{"role": "user", "content": "x"}], "reward": 1.0,
            "turns": list(turns)}


def test_replay_fields_round_trip_packed() -> None:
    blob = pack_record(TrajectoryRecord.model_validate(record(TURN, NEXT)).to_store())
    header, offset = read_header(blob)
    check_arrays(blob, header, offset)  # what a client-packed write of the same record would pass
    first, second = unpack_record(blob)["turns"]
    assert {k: first[k] for k in TURN} == TURN
    assert "routed_experts" not in second and "calls" not in second
    arrays = unpack_record_arrays(blob)[0]["turns"][0]
    assert isinstance(arrays["routed_experts"], np.ndarray) and arrays["routed_experts"].tolist() == list(range(16))
    assert arrays["top_p_token_offsets"].tolist() == [0, 2, 3]


@pytest.mark.parametrize("change, message", [
    ({"top_p_token_offsets": [0, 2]}, "top_p_token_offsets has 2 values"),
    ({"top_p_token_offsets": [0, 3, 2]}, "must start at 0 and end"),
    ({"top_p_token_ids": None}, "come together"),
    ({"routed_experts": [-1, 2]}, "routed_experts"),
    ({"calls": [{"weight_version": "v1", "surprise": 1}]}, "calls entries"),
])
def test_bad_replay_fields_are_refused_naming_the_field(change: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrajectoryRecord.model_validate(record({**TURN, **change}))
