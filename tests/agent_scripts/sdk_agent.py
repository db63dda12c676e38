"""A stand-in for an unmodified agent command: an OpenAI SDK calculator loop configured only by the
environment the sandbox gives it (OPENAI_BASE_URL, OPENAI_API_KEY). Its mode (argv[1]) makes it misbehave
the ways the agent_command tests need; it prints its final answer."""

import json
import os
import subprocess
import sys
import time

MODE, PROMPT = sys.argv[1].split("-")[0], sys.argv[2]  # "crash-1" -> crash


def first_of_its_kind(mode: str) -> bool:
    """With $MARKS set, only the first rollout of a mode misbehaves (its group still has a good member)."""
    if not os.environ.get("MARKS"):
        return True
    try:
        os.mkdir(os.path.join(os.environ["MARKS"], mode))
        return True
    except FileExistsError:
        return False


if MODE in ("crash", "hang") and not first_of_its_kind(MODE):
    MODE = "ok"
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def log(event: str) -> None:
    if os.environ.get("AGENT_LOG"):
        with open(os.environ["AGENT_LOG"], "a") as fh:
            fh.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid()}) + "\n")


def solve() -> str:
    import openai

    from rollout_buffer.testing.engine import evaluate_expression, format_number

    client = openai.OpenAI(max_retries=0)  # base URL and key from the environment only
    messages = [{"role": "user", "content": PROMPT}]
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            value = format_number(evaluate_expression(json.loads(call.function.arguments)["expression"]))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": value})
    return ""


log("start")
if MODE == "hang":  # a tree that would outlive the agent: a child, a setsid grandchild; pids to $PIDS
    kids = [subprocess.Popen(["sleep", "300"]), subprocess.Popen(["setsid", "sleep", "301"])]
    with open(os.environ["PIDS"], "w") as fh:
        fh.write(" ".join(str(p) for p in [os.getpid()] + [k.pid for k in kids]))
    solve()
    time.sleep(300)
answer = solve()
if MODE == "slow":
    time.sleep(0.5)
log("end")
print("working...", file=sys.stderr)
print(json.dumps({"result": answer}))
if MODE == "crash":
    print("agent crashed: out of ideas", file=sys.stderr)
    sys.exit(3)
