"""An agent_command task with its own steps: it prepares a file the agent reads, builds the command from the
line (not from a template), and verifies by reading what the agent wrote into the sandbox."""

import sys
from pathlib import Path

from rollout_buffer.agents.task import make_rollout

TASK_TYPE = "custom_agent"
SDK_AGENT = Path(__file__).resolve().parent.parent / "agent_scripts" / "sdk_agent.py"


async def prepare(sandbox, sample, values, config):
    await sandbox.write_file("question.txt", sample["prompt"])


def command(sample, values, config):
    script = "import subprocess, sys; q = open('question.txt').read(); " \
             "out = subprocess.run([sys.argv[1], sys.argv[2], 'ok', q], capture_output=True, text=True).stdout; " \
             "open('answer.json', 'w').write(out); print(out)"
    return [sys.executable, "-c", script, sys.executable, str(SDK_AGENT)]


async def verify(sandbox, sample, agent_result):
    import json

    answer = json.loads(await sandbox.read_file("answer.json"))["result"]
    return {"reward": 1.0 if f"\\boxed{{{sample['label']}}}" in answer else 0.0, "read": "answer.json"}


rollout = make_rollout(prepare=prepare, command=command, verify=verify)
