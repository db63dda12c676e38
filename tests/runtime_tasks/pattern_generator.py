"""A native task that calls no engine: repeat k of a line gets reward `line["rewards"][k]`, so a test
decides which groups have all-equal rewards (and which a `nonzero_std` group filter drops)."""

TASK_TYPE = "pattern"


async def rollout(sample, ctx):
    rewards = sample["rewards"]
    return {"messages": [{"role": "user", "content": str(sample["prompt"])}, {"role": "assistant", "content": "ok"}],
            "reward": float(rewards[ctx.repeat % len(rewards)])}
