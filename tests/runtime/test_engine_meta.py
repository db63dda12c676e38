"""What a turn keeps of SGLang's `meta_info` across the calls of one turn (an aborted generation continued
is several calls): slime's joining rules for top-p replay and routed experts, the per-call fields."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from rollout_buffer.runtime.engine_meta import ReplayJoin, call_meta


def _b64(values: list[int]) -> str:
    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode("ascii")


def test_calls_of_one_turn_join_as_slime_joins_them() -> None:
    join = ReplayJoin(prompt_len=5)
    # first call: 2 tokens before an abort; rows for 5 + 2 - 1 tokens, 2 values each; base64 as SGLang sends
    join.add({"routed_experts": _b64(list(range(12))), "top_p_token_ids": [7, 8, 9], "top_p_token_offsets": [0, 1, 3]},
             outputs_before=0, new_outputs=2)
    # the continuation: its prompt is the prompt + those 2 tokens; rows from row 4 on replace what was held
    join.add({"routed_experts": [100 + i for i in range(10)], "routed_experts_start_len": 4,
              "top_p_token_ids": [1, 2, 3, 4], "top_p_token_offsets": [0, 2, 3, 4]}, outputs_before=2, new_outputs=3)
    fields = join.fields(outputs=5)
    assert fields["routed_experts"] == list(range(8)) + [100 + i for i in range(10)], "rows 0-3 kept, then new"
    assert fields["routed_experts_start_len"] == 0
    assert fields["top_p_token_ids"] == [7, 8, 9, 1, 2, 3, 4]
    assert fields["top_p_token_offsets"] == [0, 1, 3, 5, 6, 7], "offsets shift by the ids so far"


def test_per_call_fields_and_bad_replay_answers() -> None:
    meta = {"weight_version": "v7", "cached_tokens": 3, "prompt_tokens": 9, "completion_tokens": 4,
            "spec_verify_ct": 2, "id": "rid", "finish_reason": {"type": "stop"}, "output_token_logprobs": []}
    assert call_meta(meta) == {"weight_version": "v7", "cached_tokens": 3, "prompt_tokens": 9,
                               "completion_tokens": 4, "spec_verify_ct": 2}
    with pytest.raises(ValueError, match="whole number of rows"):
        ReplayJoin(prompt_len=3).add({"routed_experts": [1, 2, 3]}, outputs_before=0, new_outputs=2)
    with pytest.raises(ValueError, match="top-p offsets"):
        ReplayJoin(prompt_len=3).add({"top_p_token_ids": [1], "top_p_token_offsets": [0, 1]}, outputs_before=0,
                                     new_outputs=2)
