"""Test task for remote rollouts that misbehaves on purpose, chosen by `metadata["mode"]`:

* `raise`: one engine call, then raises RuntimeError("task exploded on purpose").
* `rewrite`: one engine call, then calls again with the first user message summarised (a history rewrite).
* `rewrite_with_mask`: the same rewrite, but with an explicit `engine.set_next_response_mask(...)`.
* `sleep`: one engine call, then sleeps `metadata["sleep_s"]` seconds (to be interrupted or timed out).
* `queue`: one engine call after waiting `metadata["sleep_s"]` seconds.
* `follow_up`: one engine call, then a second one after a new user turn (`metadata["follow_up"]`).
"""

from __future__ import annotations

import asyncio
from typing import Any

TASK_TYPE = "remote_faults"


async def rollout(sample: dict[str, Any], ctx: Any) -> dict[str, Any]:
    metadata = sample.get("metadata") or {}
    mode = metadata.get("mode")
    messages = list(sample["messages"])
    if mode == "queue":
        await asyncio.sleep(float(metadata.get("sleep_s", 0)))
    first = await ctx.engine.chat(messages, tools=sample.get("tools"))
    messages.append(first.message)
    if mode == "raise":
        raise RuntimeError("task exploded on purpose")
    if mode in ("rewrite", "rewrite_with_mask"):
        # Summarise the first question away: earlier messages change, the list still grows.
        rewritten = [{"role": "user", "content": "(summary) an arithmetic question"}, *messages[1:],
                     {"role": "user", "content": "Now compute 2 + 2."}]
        if mode == "rewrite_with_mask":
            ctx.engine.set_next_response_mask([0] * int(metadata.get("mask_len", 5)))
        second = await ctx.engine.chat(rewritten, tools=sample.get("tools"))
        messages = [*rewritten, second.message]
    if mode == "follow_up":
        messages.append({"role": "user", "content": str(metadata.get("follow_up", "Thanks. And 2 + 2?"))})
        second = await ctx.engine.chat(messages, tools=sample.get("tools"))
        messages.append(second.message)
    if mode == "sleep":
        await asyncio.sleep(float(metadata.get("sleep_s", 60)))
    return {"messages": messages, "reward": 0.5}
