"""Built-in task `math`: one model answer per prompt, rewarded 1.0 when its last `\\boxed{}` matches the label.

A template to copy for a single-turn native task. Input lines need a prompt (`messages`, `prompt` or
`question`) and a label (`label` or `answer`). Groups are GRPO-normalised when the trainer reads them
(`transform_group`); the reward before normalisation stays in `raw_reward`.
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.generator.boxed import boxed_reward, extract_boxed
from rollout_buffer.groups import grpo_normalize_group
from rollout_buffer.task_contract import RolloutContext

TASK_TYPE = "math"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def prompt_messages(sample: dict[str, Any], instruction: str = INSTRUCTION) -> list[dict[str, Any]]:
    """The chat prompt of a line: its `messages`, or its `prompt`/`question` text as one user message."""
    messages = sample.get("messages")
    if isinstance(messages, list) and messages:
        return [dict(m) for m in messages]
    text = sample.get("prompt", sample.get("question"))
    if not isinstance(text, str) or not text:
        raise ValueError("input line has no 'messages', 'prompt' or 'question'")
    return [{"role": "user", "content": f"{text}\n{instruction}" if instruction else text}]


def label_of(sample: dict[str, Any]) -> Any:
    return sample.get("label", sample.get("answer"))


async def rollout(sample: dict[str, Any], ctx: RolloutContext) -> dict[str, Any]:
    messages = prompt_messages(sample)
    answer = await ctx.engine.chat(messages)
    messages.append(answer.message)
    label = label_of(sample)
    content = answer.message.get("content", "")
    return {
        "messages": messages,
        "reward": boxed_reward(content, label),
        "extra_info": {"label": label, "predicted": extract_boxed(content)},
    }


def transform_group(group: tuple[str, list[dict[str, Any]]], task_type: str) -> tuple[str, list[dict[str, Any]]]:
    return grpo_normalize_group(group, task_type)
