"""A native task that calls no engine and reports what it was given: the normalised sample's fields and
the raw line (`ctx.line`), so a test can see the runtime's key mapping."""

TASK_TYPE = "echo_line"


async def rollout(sample, ctx):
    seen = {name: sample.get(name) for name in ("instance_id", "prompt", "label", "metadata", "tools")}
    return {"messages": [{"role": "user", "content": str(sample["prompt"])}], "reward": 1.0,
            "extra_info": {"sample": seen, "line": ctx.line, "sample_keys": sorted(sample)}}
