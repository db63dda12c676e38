"""Realistic trajectory records for benchmarks: 4 turns, ~2,000 generated token ids with logprobs,
~8 KB of message text, prompts that extend each other as a multi-turn engine session's do."""

from __future__ import annotations

import random
from typing import Any

import numpy as np


def realistic_record(instance_id: str, uid: str, *, seed: int = 0, turns: int = 4, first_prompt: int = 200,
                     output_per_turn: int = 450, tool_tokens: int = 60, text_bytes: int = 8000) -> dict[str, Any]:
    rng = random.Random(seed)
    prompt = [rng.randrange(151_000) for _ in range(first_prompt)]
    recorded: list[dict[str, Any]] = []
    for turn in range(turns):
        output = [rng.randrange(151_000) for _ in range(output_per_turn)]
        # engines compute logprobs in float32 and send them as the doubles those values are
        logprobs = np.asarray([-rng.random() * 4 for _ in output], dtype=np.float32).astype(np.float64).tolist()
        recorded.append({"prompt_ids": list(prompt), "output_ids": output, "output_logprobs": logprobs,
                         "finish_reason": "stop", "weight_version": "7"})
        prompt = prompt + output + [rng.randrange(151_000) for _ in range(tool_tokens)]
    chunk = max(text_bytes // (2 * turns + 1), 1)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "q" * chunk}]
    for turn in range(turns):
        messages.append({"role": "assistant", "content": "a" * chunk})
        if turn < turns - 1:
            messages.append({"role": "tool", "content": "t" * chunk, "tool_call_id": f"call_{turn}"})
    return {"uid": uid, "instance_id": instance_id, "messages": messages, "reward": rng.random(),
            "extra_info": {"source": "bench"}, "status": "completed", "turns": recorded}
