"""Built-in task `calculator`: multi-turn tool use. The model may call a calculator; its results come back
as `role="tool"` messages (with `tool_call_id`) until the model answers in `\\boxed{}` or `MAX_TURNS` is
reached. Reward: 1.0 when the final boxed answer matches the label.

A template to copy for a multi-turn native task: declare `TOOLS`, loop on `ctx.engine.chat`, append the
returned assistant message and the tool results, never edit earlier messages (the engine client records
the exact tokens of every turn and refuses a rewritten history). Input lines are read like `math`'s
(`validate_sample` is the same); tools given per line (`tool_key`) are offered after the calculator, and a
call to one of them gets an error result, since this task can run only the calculator.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable
from typing import Any

from rollout_buffer.tasks.builtin.boxed import boxed_reward, extract_answer
from rollout_buffer.tasks.builtin.math_generator import label_of, prompt_messages, validate_sample
from rollout_buffer.tasks.contract import RolloutContext

__all__ = ["MAX_TURNS", "TASK_TYPE", "TOOLS", "calculate", "offered_tools", "rollout", "run_tool_call",
           "validate_sample"]

TASK_TYPE = "calculator"
MAX_TURNS = 4
MAX_EXPRESSION_CHARS = 200
INSTRUCTION = "Use the calculator tool for arithmetic, then put your final answer within \\boxed{}."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (12 + 3) * 4"}},
                "required": ["expression"],
            },
        },
    }
]

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def calculate(expression: str) -> str:
    """Arithmetic only (numbers, + - * /, parentheses), parsed with `ast`: nothing is ever executed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, RecursionError) as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def run_tool_call(call: dict[str, Any]) -> str:
    """Execute one OpenAI-style tool call; every problem becomes an error string the model can read."""
    function = call.get("function") or {}
    if function.get("name") != "calculator":
        return f"error: unknown tool {function.get('name')!r}"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str):
        return "error: missing string argument 'expression'"
    return calculate(expression)


def offered_tools(sample: dict[str, Any]) -> list[dict[str, Any]]:
    """The calculator, then the line's own tools whose names differ from it."""
    ours = {tool["function"]["name"] for tool in TOOLS}
    extra = [tool for tool in sample.get("tools") or []
             if (tool.get("function") or {}).get("name", tool.get("name")) not in ours]
    return [*TOOLS, *extra]


async def rollout(sample: dict[str, Any], ctx: RolloutContext) -> dict[str, Any]:
    messages = prompt_messages(sample, INSTRUCTION)
    tools = offered_tools(sample)
    tool_calls = 0
    status = "completed"
    for turn in range(MAX_TURNS):
        answer = await ctx.engine.chat(messages, tools=tools)
        messages.append(answer.message)
        calls = answer.message.get("tool_calls") or []
        if not calls or answer.finish_reason != "stop":
            break
        if turn == MAX_TURNS - 1:
            status = "truncated"  # still calling tools when the turn budget ran out
            break
        for call in calls:
            tool_calls += 1
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                             "content": run_tool_call(call)})
    final = (messages[-1].get("content") or "") if messages[-1]["role"] == "assistant" else ""
    label = label_of(sample)
    result: dict[str, Any] = {
        "messages": messages,
        "reward": boxed_reward(final, label),
        "extra_info": {"label": label, "predicted": extract_answer(final), "tool_calls": tool_calls},
    }
    if status != "completed":
        result["status"] = status
    return result
