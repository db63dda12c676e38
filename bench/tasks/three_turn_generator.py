"""Benchmark task: a calculator-style rollout of exactly three engine calls (tool call, answer, tool call
on a follow-up question), the shape of a small agent loop."""

from rollout_buffer.tasks.builtin.calculator_generator import TOOLS, run_tool_call

TASK_TYPE = "bench_three_turn"
TURNS = 3


async def rollout(sample, ctx):
    messages = [{"role": "user", "content": sample["prompt"]}]
    for turn in range(TURNS):
        answer = await ctx.engine.chat(messages, tools=TOOLS)
        messages.append(answer.message)
        if turn == TURNS - 1:
            break
        calls = answer.message.get("tool_calls") or []
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": run_tool_call(call)})
        if not calls:
            messages.append({"role": "user", "content": sample["follow_up"]})
    return {"messages": messages, "reward": 1.0 if len(ctx.engine.turns) == TURNS else 0.0}
