"""Trajectory records in the runtime's shape for the read-path tests (real Qwen token ids, OpenAI tool calls
with string `arguments`, whitespace at turn edges), and helpers to compare answers exactly."""

from __future__ import annotations

import random
import struct
from typing import Any

import numpy as np

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]


def plain(value: Any) -> Any:
    """Arrays as lists, recursively: the JSON answer's shape."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def bits(values: Any) -> list[int]:
    """Float64 values as their bit patterns: equal exactly when bit-identical."""
    return [struct.unpack("<q", struct.pack("<d", float(v)))[0] for v in values]


def ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def tool_trajectory(tok: Any, instance_id: str, seed: int, *, exact32: bool) -> dict[str, Any]:
    """A two-call tool-use record in the runtime's shape: the second prompt extends the first call's prompt
    and output by the tool result; an OpenAI tool call with string `arguments`; whitespace at turn edges.
    Logprobs are float64 values that float32 cannot hold (a JSON writer's), or float32-exact (an engine's)."""
    rng = random.Random(seed)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the calculator.\n"},
        {"role": "user", "content": f"  What is {a} * {b}?"},
    ]
    prompt = tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=False,
                                     add_generation_prompt=True)
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": f'{{"expression": "{a} * {b}"}}'}}
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call_text = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call>'
    out1 = ids(tok, call_text) + [end]
    tail = ids(tok, f"\n<|im_start|>user\n<tool_response>\n{a * b}\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    out2 = ids(tok, f"\nIt is {a * b}.  ") + [end]

    def logprobs(n: int) -> list[float]:
        values = [-rng.random() * 5 for _ in range(n)]
        return [float(np.float32(v)) for v in values] if exact32 else values

    turns = [
        {"prompt_ids": prompt, "output_ids": out1, "output_logprobs": logprobs(len(out1)), "finish_reason": "stop",
         "weight_version": "3"},
        {"prompt_ids": prompt + out1 + tail, "output_ids": out2, "output_logprobs": logprobs(len(out2)),
         "finish_reason": "stop", "weight_version": 3, "version_spans": [[3, 1], [4, len(out2) - 1]]},
    ]
    messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)},
                 {"role": "assistant", "content": f"\nIt is {a * b}.  "}]
    return {"uid": f"{instance_id}-{seed}", "instance_id": instance_id, "messages": messages, "tools": TOOLS,
            "reward": float(rng.random()), "extra_info": {"label": str(a * b)}, "status": "completed",
            "timestamp": 1000.0 + seed, "turns": turns}


def forked_trajectory(tok: Any, instance_id: str, seed: int) -> dict[str, Any]:
    """A record whose second prompt does not extend the first call (the history was re-rendered) and whose
    first call has no logprobs."""
    record = tool_trajectory(tok, instance_id, seed, exact32=False)
    first, second = record["turns"]
    first["output_logprobs"] = None
    second["prompt_ids"] = tok.encode(tok.decode(second["prompt_ids"]), add_special_tokens=False)[::-1][:50]
    del second["version_spans"]
    return record
