"""Harbor's verification, in the agent's container once the agent's command has ended.

As root in the container (never the agent's user): `/tests` and `/logs/verifier` are removed and made anew
(whatever the agent planted there is gone), the task's `tests/` folder is uploaded to `/tests`, `bash
/tests/test.sh` runs in the work folder under `[verifier] timeout_sec` with `[verifier] env` added to the
image's environment, and the reward is read from `/logs/verifier/reward.txt` (a number) or, failing that,
`/logs/verifier/reward.json` (an object with a numeric `reward`; its other keys are kept). The verdict carries
test.sh's exit code and output tails. No reward file, or one that does not hold a number, raises
`VerifierError`: a counted `verifier_error`, never a zero.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

from rollout_buffer.agents.harbor.images import folder_tar
from rollout_buffer.agents.sandbox import Sandbox
from rollout_buffer.agents.verifiers import AgentResult, VerifierError

TAIL_CHARS = 2000
SETUP_TIMEOUT_S = 120.0
_RESET = "rm -rf /tests /logs/verifier && mkdir -p /tests /logs/verifier && chmod 0777 /logs/verifier"
_READ = ('if [ -f /logs/verifier/reward.txt ]; then echo txt; head -c 65536 /logs/verifier/reward.txt; '
         'elif [ -f /logs/verifier/reward.json ]; then echo json; head -c 65536 /logs/verifier/reward.json; '
         'else echo none; fi')


def tests_archive(task_dir: str | Path) -> bytes:
    """The task's `tests/` folder as a tar (read from the task folder now: never stored, never the agent's)."""
    return folder_tar(Path(task_dir) / "tests")


def parse_reward(kind: str, text: str) -> dict[str, Any]:
    """The reward file's content -> `{"reward": float, ...extra keys}`; VerifierError when it holds none."""
    if kind == "txt":
        try:
            value = float(text.strip())
        except ValueError as exc:
            raise VerifierError(f"/logs/verifier/reward.txt does not hold a number: {text[:200]!r}") from exc
        extra: dict[str, Any] = {}
    elif kind == "json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise VerifierError(f"/logs/verifier/reward.json is not JSON: {text[:200]!r}") from exc
        if not isinstance(data, dict) or isinstance(data.get("reward"), bool) \
                or not isinstance(data.get("reward"), (int, float)):
            raise VerifierError(f"/logs/verifier/reward.json has no numeric 'reward': {text[:200]!r}")
        value, extra = float(data["reward"]), {k: v for k, v in data.items() if k != "reward"}
    else:
        raise VerifierError("test.sh wrote no reward (neither /logs/verifier/reward.txt nor reward.json)")
    if not math.isfinite(value):
        raise VerifierError(f"the reward is not a finite number: {value!r}")
    return {"reward": value, **extra}


async def harbor_verify(sandbox: Sandbox, sample: dict[str, Any], agent: AgentResult) -> dict[str, Any]:
    """Run the task's tests/test.sh as Harbor does (module docstring) and return the verdict."""
    harbor = sample["harbor"]
    root = getattr(sandbox, "exec_root", None)
    if root is None:
        raise VerifierError("a Harbor task's verifier runs as root in the agent's container: use the docker backend")
    reset = await root(["sh", "-c", _RESET], timeout_s=SETUP_TIMEOUT_S)
    if not reset.ok:
        raise VerifierError(f"cannot empty /tests and /logs/verifier (exit {reset.exit_code}): {reset.stderr[-300:]}")
    archive = await asyncio.to_thread(tests_archive, harbor["dir"])
    upload = await root(["tar", "-x", "-C", "/tests", "-f", "-"], timeout_s=SETUP_TIMEOUT_S, stdin=archive)
    if not upload.ok:
        raise VerifierError(f"cannot upload tests/ to /tests (exit {upload.exit_code}): {upload.stderr[-300:]}")
    env = [f"{name}={value}" for name, value in (harbor.get("verifier_env") or {}).items()]
    run = await root(["env", *env, "bash", "/tests/test.sh"], timeout_s=float(harbor["verifier_timeout_sec"]))
    info = {"test_exit_code": run.exit_code, "test_timed_out": run.timed_out,
            "test_stdout_tail": run.stdout[-TAIL_CHARS:], "test_stderr_tail": run.stderr[-TAIL_CHARS:]}
    read = await root(["sh", "-c", _READ], timeout_s=SETUP_TIMEOUT_S)
    kind, _, text = read.stdout.partition("\n")
    try:
        verdict = parse_reward(kind.strip() if read.ok else "none", text)
    except VerifierError as exc:
        raise VerifierError(f"{exc}; test.sh exit {run.exit_code}, timed out {run.timed_out}; stdout tail: "
                            f"{run.stdout[-600:]!r}; stderr tail: {run.stderr[-600:]!r}") from exc
    return {**verdict, **info}
