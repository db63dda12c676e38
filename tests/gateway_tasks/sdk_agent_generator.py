"""A native task whose agent is an ordinary OpenAI SDK tool loop, run in the rollout through
`ctx.session()` (the agent gateway) instead of `ctx.engine`."""

import json

import openai

from rollout_buffer.testing.engine import evaluate_expression, format_number

TASK_TYPE = "sdk_agent"
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


async def rollout(sample: dict, ctx) -> dict:
    session = await ctx.session()
    assert await ctx.session() == session, "one session per rollout"
    agent = openai.AsyncOpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(4):
        reply = (await agent.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR]))
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            value = evaluate_expression(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": format_number(value)})
    await agent.close()
    reward = 1.0 if f"\\boxed{{{sample['label']}}}" in (messages[-1].get("content") or "") else 0.0
    return {"messages": messages, "reward": reward, "extra_info": {"session_id": session["session_id"]}}
