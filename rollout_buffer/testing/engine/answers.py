"""The scripted answers: what the test engine's "model" says to a rendered prompt.

It finds the last arithmetic question of the last user turn, calls the calculator tool when the prompt
offers one (also as `<namespace>.calculator`; else a `Bash` tool, Claude Code's shell, `exec_command`,
Codex's, or `bash`, mini-swe-agent's or OpenCode's, with `echo $(( expr ))`), answers in `\\boxed{}` from a
tool result when one came back (to mini-swe-agent with its submit command, the only way it ends; OpenCode's
`bash` comes with file tools, mini-swe-agent's alone), and otherwise
answers directly, right with probability `p_correct`. Plain text in, plain text out: the
token-level policy (noise tokens, think blocks, logprobs) wraps it.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import random
import re
from collections.abc import Callable
from typing import Any

Responder = Callable[[str, random.Random], str]

_USER_MARKERS = ("<|im_start|>user\n", "<｜User｜>")
_TURN_ENDS = ("<|im_end|>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
_TOOL_RESULT_RES = (
    re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL),
    re.compile(r"<｜tool▁output▁begin｜>(.*?)<｜tool▁output▁end｜>", re.DOTALL),
)
_CALCULATOR_RE = re.compile(r'"name"\s*:\s*"((?:[\w-]+\.)?calculator)"')  # maybe in a namespace (`math.calculator`)
_BASH_RE = re.compile(r'"name"\s*:\s*"Bash"')  # Claude Code's shell tool
_EXEC_RE = re.compile(r'"name"\s*:\s*"exec_command"')  # Codex CLI's shell tool
_MINI_RE = re.compile(r'"name"\s*:\s*"bash"')  # mini-swe-agent's shell tool (its only one), or OpenCode's
_FILE_TOOLS_RE = re.compile(r'"name"\s*:\s*"(?:read|edit|write|glob|grep)"')  # OpenCode's others: not mini
MINI_SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_EXPR_RE = re.compile(r"[\d(][\d\s.+\-*/()]*[\d)]")
_HAS_OP_RE = re.compile(r"\d\s*\)*\s*[-+*/]\s*\(*\s*\d")
_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_node(node.operand))
    raise ValueError("not arithmetic")


@functools.lru_cache(maxsize=4096)
def evaluate_expression(expr: str) -> float:
    """Evaluate + - * / arithmetic safely (no names, no calls)."""
    return _eval_node(ast.parse(expr.strip(), mode="eval"))


def format_number(value: float) -> str:
    """Render a result the way a grader expects: integers without a decimal point."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


def find_last_expression(text: str) -> tuple[str, float] | None:
    """Return the last evaluable arithmetic expression in text and its value."""
    for match in reversed(list(_EXPR_RE.finditer(text))):
        candidate = match.group(0).strip()
        if not _HAS_OP_RE.search(candidate):
            continue
        try:
            return candidate, evaluate_expression(candidate)
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError):
            continue
    return None


def _last_user_query(prompt: str) -> tuple[str, int]:
    """Return (text, end offset) of the last user turn that is not a tool result."""
    best: tuple[int, str, int] | None = None
    for marker in _USER_MARKERS:
        start = 0
        while (found := prompt.find(marker, start)) >= 0:
            body_start = found + len(marker)
            ends = [i for i in (prompt.find(e, body_start) for e in _TURN_ENDS) if i >= 0]
            end = min(ends) if ends else len(prompt)
            body = prompt[body_start:end]
            if not body.lstrip().startswith("<tool_response>") and (best is None or body_start > best[0]):
                best = (body_start, body, end)
            start = body_start
    if best is None:
        return prompt, len(prompt)
    return best[1], best[2]


def default_responder(prompt_text: str, rng: random.Random, p_correct: float = 0.5) -> str:
    """Script an answer: call the calculator tool if offered, else answer (maybe wrongly)."""
    query, query_end = _last_user_query(prompt_text)
    found = find_last_expression(query)
    if found is None:
        return "I could not find an arithmetic expression to compute."
    expr, value = found
    after = prompt_text[query_end:]
    results = [m.group(1).strip() for pattern in _TOOL_RESULT_RES for m in pattern.finditer(after)]
    if results:
        try:
            value = float(results[-1])
        except ValueError:
            pass
        if _is_mini(prompt_text):  # mini-swe-agent ends on its submit command's output
            command = f"echo {MINI_SUBMIT} && echo {format_number(value)}"
            return _call("bash", {"command": command})
        return f"The answer is \\boxed{{{format_number(value)}}}"
    calculator = _CALCULATOR_RE.search(prompt_text)
    if calculator:
        call = {"name": calculator.group(1), "arguments": {"expression": expr}}
        return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
    if _BASH_RE.search(prompt_text):  # an agent with a shell (Claude Code): compute it there
        call = {"name": "Bash", "arguments": {"command": f"echo $(( {expr} ))", "description": "Compute the value"}}
        return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
    if _EXEC_RE.search(prompt_text):  # Codex CLI: compute it in its shell
        call = {"name": "exec_command", "arguments": {"cmd": f"echo $(( {expr} ))"}}
        return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
    if _MINI_RE.search(prompt_text):  # mini-swe-agent's, or OpenCode's (which wants a description)
        extra = {} if _is_mini(prompt_text) else {"description": "Compute the value"}
        return _call("bash", {"command": f"echo $(( {expr} ))", **extra})
    if rng.random() >= p_correct:
        value = value + rng.choice([-3, -2, -1, 1, 2, 3, 10])
    return f"The answer is \\boxed{{{format_number(value)}}}"


def _is_mini(prompt_text: str) -> bool:
    """mini-swe-agent offers a `bash` tool and nothing else; OpenCode's `bash` comes with file tools."""
    return bool(_MINI_RE.search(prompt_text)) and not _FILE_TOOLS_RE.search(prompt_text)


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"
