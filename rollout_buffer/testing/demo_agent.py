"""A minimal agent command for `rollout-buffer demo --agent`: a stand-in for an unmodified agent that only
knows the OpenAI Chat Completions API, configured by `OPENAI_BASE_URL` and `OPENAI_API_KEY` from its
environment. It offers a calculator tool, runs the calls the model makes, and prints the final answer as
`{"result": ...}` (what the `exact_answer` verifier reads).

Usage: python -m rollout_buffer.testing.demo_agent "What is 6 * 7?"
"""

from __future__ import annotations

import json
import os
import sys

import httpx

from rollout_buffer.testing.engine import evaluate_expression, format_number

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def main(prompt: str) -> int:
    base, key = os.environ["OPENAI_BASE_URL"].rstrip("/"), os.environ["OPENAI_API_KEY"]
    messages: list[dict] = [{"role": "user", "content": prompt}]
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        for _ in range(8):
            answer = client.post("/chat/completions", json={"model": "policy", "messages": messages,
                                                            "tools": [CALCULATOR]})
            answer.raise_for_status()
            message = answer.json()["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if v is not None})
            if not message.get("tool_calls"):
                print(json.dumps({"result": message.get("content") or ""}))
                return 0
            for call in message["tool_calls"]:
                expression = json.loads(call["function"]["arguments"])["expression"]
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": format_number(evaluate_expression(expression))})
    print("no final answer after 8 calls", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
