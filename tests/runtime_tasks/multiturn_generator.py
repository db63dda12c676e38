"""A native task with `turns` engine calls (the line's `turns`, default 3): the prompt, then "Go on."
after each answer. Reward 1.0. For tests of what one record keeps per turn."""

TASK_TYPE = "multiturn"


async def rollout(sample, ctx):
    messages = [{"role": "user", "content": str(sample["prompt"])}]
    for _ in range(int(sample.get("turns", 3))):
        if len(messages) > 1:
            messages.append({"role": "user", "content": "Go on."})
        answer = await ctx.engine.chat(messages)
        messages.append(answer.message)
    return {"messages": messages, "reward": 1.0}
