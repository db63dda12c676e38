"""Test task for remote rollouts: a calculator tool loop.

The model may call `calculator`; each call's result is appended as a `role="tool"` message and the model
is asked again, until it answers without a tool call. Reward 1.0 when the boxed answer equals
`metadata["answer"]`.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

TASK_TYPE = "remote_calculator"
MAX_CALLS = 4
TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}
_BOXED = re.compile(r"\\boxed\{([^}]*)\}")


def _calc(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _calc(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_calc(node.left), _calc(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_calc(node.operand))
    raise ValueError("not arithmetic")


def calculator(expression: str) -> str:
    try:
        value = _calc(ast.parse(expression, mode="eval"))
    except (ValueError, SyntaxError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


async def rollout(sample: dict[str, Any], ctx: Any) -> dict[str, Any]:
    messages = list(sample["messages"])
    tools = sample.get("tools")
    for _ in range(MAX_CALLS):
        result = await ctx.engine.chat(messages, tools=tools, sampling_params=ctx.sampling_params)
        messages.append(result.message)
        calls = result.message.get("tool_calls") or []
        if not calls:
            break
        for call in calls:
            arguments = call["function"]["arguments"]
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            messages.append({"role": "tool", "content": calculator(str(arguments.get("expression", ""))),
                             "tool_call_id": call["id"]})
    found = _BOXED.findall(messages[-1].get("content") or "")
    answer = (sample.get("metadata") or {}).get("answer")
    reward = 1.0 if found and answer is not None and found[-1].strip() == str(answer) else 0.0
    return {"messages": messages, "reward": reward, "extra_info": {"tool_calls": len(messages) - 2}}
