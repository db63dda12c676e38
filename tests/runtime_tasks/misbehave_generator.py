"""A native task that misbehaves on purpose in repeat 0 (the other repeats behave), by the line's `mode`:
`ok` (one honest turn), `raise` (an exception), `hang` (never returns), `rewrite` (edits the history
between two engine calls), `bad_result` (returns no reward)."""

import asyncio

TASK_TYPE = "misbehave"


async def rollout(sample, ctx):
    messages = [{"role": "user", "content": sample["prompt"]}]
    mode = sample.get("mode", "ok") if ctx.repeat == 0 else "ok"
    if mode == "raise":
        raise RuntimeError(f"task failure on purpose ({sample['instance_id']})")
    if mode == "hang":
        await asyncio.Event().wait()
    answer = await ctx.engine.chat(messages)
    messages.append(answer.message)
    if mode == "rewrite":
        messages[0] = {"role": "user", "content": "something else"}
        messages.append({"role": "user", "content": "and now?"})
        await ctx.engine.chat(messages)
    if mode == "bad_result":
        return {"messages": messages}
    return {"messages": messages, "reward": 1.0, "extra_info": {"mode": mode}}
