"""Small Harbor task folders for the tests, in Harbor's real layout (instruction.md, task.toml, environment/,
tests/test.sh, solution/solve.sh): a file to create, a Python bug to fix (its image built from
environment/Dockerfile on the tests' base image), a non-binary reward.json, and one whose test.sh writes no
reward. Every tests/ and solution/ file carries SECRET, so a hostile agent that reads one is caught."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx

SECRET = "zebra-quartz-7719"
SCRIPTED_AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "agent_scripts" / "harbor_agent.py"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _toml(image: str | None, *, verifier_env: str = "{}", agent_timeout: int = 120) -> str:
    env = f'docker_image = "{image}"\n' if image else ""
    return (f'version = "1.0"\n\n[metadata]\ndifficulty = "easy"\ntags = ["test"]\n\n[verifier]\ntimeout_sec = 60.0\n'
            f'env = {verifier_env}\n\n[agent]\ntimeout_sec = {agent_timeout}.0\n\n[environment]\n{env}'
            'build_timeout_sec = 300.0\ncpus = 1\nmemory_mb = 512\nstorage_mb = 64\n')


def make_dataset(root: Path, base_image: str) -> Path:
    """Four tasks under `root` (a folder of task folders); returns `root`."""
    secret = f"# {SECRET}\n"
    _write(root / "hello", {
        "instruction.md": "Create the file /app/hello.txt holding the word hello.\n",
        "task.toml": _toml(base_image, verifier_env='{ GREETING = "hi there" }'),
        "tests/test.sh": ("#!/bin/bash\n" + secret + 'echo "GREETING=$GREETING"\n'
                          'if [ "$(cat /app/hello.txt 2>/dev/null)" = "hello" ]; then '
                          "echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"),
        "solution/solve.sh": "#!/bin/bash\n" + secret + "echo hello > /app/hello.txt\n"})
    _write(root / "fix-bug", {
        "instruction.md": "calc.py's add() is wrong: fix it.\n",
        "task.toml": _toml(None),
        "environment/Dockerfile": f"FROM {base_image}\nWORKDIR /app\nCOPY calc.py /app/calc.py\n",
        "environment/calc.py": "def add(a, b):\n    return a - b\n",
        "tests/test.sh": ("#!/bin/bash\n" + secret + "cd /app\nif python3 /tests/test_calc.py; then "
                          "echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"),
        "tests/test_calc.py": (secret + "import sys, unittest\nsys.path.insert(0, '/app')\nimport calc\n\n\n"
                               "class T(unittest.TestCase):\n    def test_add(self):\n"
                               "        self.assertEqual(calc.add(2, 3), 5)\n\n\nunittest.main()\n"),
        "solution/solve.sh": "#!/bin/bash\n" + secret + "sed -i 's/a - b/a + b/' /app/calc.py\n"})
    _write(root / "partial", {
        "instruction.md": "Write 2+2 and 3+3 on the first two lines of /app/answers.txt.\n",
        "task.toml": _toml(base_image),
        "tests/test.sh": ("#!/bin/bash\n" + secret + "python3 - <<'PY'\nimport json\n"
                          "try:\n    got = open('/app/answers.txt').read().split()\nexcept OSError:\n    got = []\n"
                          "passed = sum(1 for a, b in zip(got, ['4', '6']) if a == b)\n"
                          "json.dump({'reward': passed / 2, 'passed': passed, 'total': 2}, "
                          "open('/logs/verifier/reward.json', 'w'))\nPY\n"),
        "solution/solve.sh": "#!/bin/bash\n" + secret + "printf '4\\n6\\n' > /app/answers.txt\n"})
    _write(root / "no-reward", {
        "instruction.md": "Write a note.\n",
        "task.toml": _toml(base_image),
        "tests/test.sh": "#!/bin/bash\n" + secret + "echo 'checked, but wrote no reward'\n",
        "solution/solve.sh": "#!/bin/bash\n" + secret + "true\n"})
    return root


def scripted_agent(mode: str) -> dict:
    """The run's `agent` options for the scripted agent (`harbor_agent.py`, written into the sandbox's home)."""
    script = SCRIPTED_AGENT.read_text().replace("{", "{{").replace("}", "}}")
    return {"command": f"python3 {{home}}/agent.py {{instance_id}} {mode} {{prompt}}", "api": "openai",
            "files": {"~/agent.py": script}, "env": {"SECRET_SOLUTION_WORD": SECRET}}


def start_harbor_run(client: httpx.Client, dataset: Path, agent: dict[str, Any], *, engine_url: str,
                     tokenizer_path: str, prefix: str = "harbor", repeats: int = 1,
                     num_process: int | None = None) -> httpx.Response:
    """`/start_rollout` of an `agent_command` run over a Harbor dataset folder (16 tokens a turn, temperature 1)."""
    body: dict[str, Any] = {
        "task_type": "agent_command", "input_file": str(dataset), "num_repeat_per_sample": repeats,
        "remote_engine_url": engine_url, "tokenizer_path": tokenizer_path, "run_id": f"{prefix}-{uuid.uuid4().hex[:8]}",
        "sampling_params": {"max_tokens": 16, "temperature": 1.0}, "agent": agent}
    if num_process is not None:
        body["num_process"] = num_process
    return client.post("/start_rollout", json=body)


def add_broken_build(root: Path) -> Path:
    """A task whose environment/Dockerfile cannot build (its base image is not in the Engine: never pulled)."""
    _write(root / "broken-build", {
        "instruction.md": "Anything.\n", "task.toml": _toml(None),
        "environment/Dockerfile": "FROM rollout-buffer-no-such-base:0\nRUN true\n",
        "tests/test.sh": "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "#!/bin/bash\ntrue\n"})
    return root
