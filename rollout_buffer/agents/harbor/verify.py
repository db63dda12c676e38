"""Harbor's verification, in the container the run's verify mode gives (`agents/verify`), once the agent's
command has ended.

As root there (never the agent's user): `/tests` and `/logs/verifier` are removed and made anew (whatever the
agent planted there is gone), the task's `tests/` folder is uploaded to `/tests`, and `bash /tests/test.sh`
runs in the image's working folder under `[verifier] timeout_sec`, in the fixed environment of
`agents/verify/environment.py`. The reward is read from `/logs/verifier/reward.txt` (a number) or, failing
that, `/logs/verifier/reward.json` (an object with a numeric `reward`; its other keys are kept, capped), and
must be finite and in the task's range. The verdict carries the mode, test.sh's exit code and output tails.

A failure before test.sh starts (a container, a commit, a copy, the upload: the Engine's) is a
`SandboxError`: infrastructure, retried, never a reward. Once test.sh has started every failure is a
`KeptFailure` (`agents/verify/reward.py`): the agent's, kept in its group with the run's failure reward.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from rollout_buffer.agents.egress import Allowlist, EgressProxy, Mirrors
from rollout_buffer.agents.harbor.images import folder_tar
from rollout_buffer.agents.harbor.network import phase_allowlist, proxy_env
from rollout_buffer.agents.sandbox import SandboxError
from rollout_buffer.agents.verifiers import AgentResult, Verifier, VerifierError
from rollout_buffer.agents.verify.boxes import engine_answers, image_env, verifier_box
from rollout_buffer.agents.verify.environment import env_argv, verifier_env
from rollout_buffer.agents.verify.keep import keep_work
from rollout_buffer.agents.verify.policy import DEFAULT_RANGE, VerifyPolicy
from rollout_buffer.agents.verify.reward import KeptFailure, parse_reward

TAIL_CHARS = 2000
SETUP_TIMEOUT_S = 120.0
_RESET = "rm -rf /tests /logs/verifier && mkdir -p /tests /logs/verifier && chmod 0777 /logs/verifier"
_READ = ('if [ -f /logs/verifier/reward.txt ]; then echo txt; head -c 65536 /logs/verifier/reward.txt; '
         'elif [ -f /logs/verifier/reward.json ]; then echo json; head -c 65536 /logs/verifier/reward.json; '
         'else echo none; fi')


def tests_archive(task_dir: str | Path, tests_dir: str | Path | None = None) -> bytes:
    """The task's `tests/` folder as a tar (read from the task folder now: never stored, never the agent's);
    `tests_dir`: another folder in its place (`rollout-buffer reverify --tests`)."""
    return folder_tar(Path(tests_dir) if tests_dir else Path(task_dir) / "tests")


def harbor_verifier(policy: VerifyPolicy, egress: dict[str, tuple[str, ...]] | None = None,
                    upstream: str = "", mirrors: tuple[str, ...] = (), work_store: Path | None = None) -> Verifier:
    """The run's Harbor verifier: `harbor_verify` under the run's verify policy, its egress what this server
    grants the verifier (`egress`: `ServerFacts.egress`) within what the task asks, `mirrors` its mirror map.
    `work_store`: where `agent.verify.keep_work` keeps the work products (`agents/verify/keep.py`)."""
    routes = Mirrors.parse(mirrors)

    async def verify(sandbox: Any, sample: dict[str, Any], agent: AgentResult) -> dict[str, Any]:
        harbor = sample["harbor"]
        verdict = await harbor_verify(sandbox, sample, agent, mode=policy.mode_for(harbor["name"]),
                                      bounds=policy.reward_range or _task_range(harbor),
                                      outputs=[*(harbor.get("outputs") or []), *policy.outputs],
                                      egress=phase_allowlist(harbor, "verifier", egress or {}), upstream=upstream,
                                      reward_key=policy.reward_key, reward_weights=policy.reward_weights,
                                      mirrors=routes, keep_to=work_store if policy.keep_work else None,
                                      safe_path=policy.safe_path_for(harbor["name"]))
        if policy.keep_work and work_store is None:  # said, never silently missing
            verdict["work_products_dropped"] = "the run has no archive (--archive-dir or its 'archive' option)"
        return verdict

    return verify


def _task_range(harbor: dict[str, Any]) -> tuple[float, float]:
    bounds = harbor.get("reward_range")
    return (float(bounds[0]), float(bounds[1])) if bounds else DEFAULT_RANGE


async def _setup(box: Any, harbor: dict[str, Any]) -> None:
    reset = await box.exec_root(["sh", "-c", _RESET], timeout_s=SETUP_TIMEOUT_S)
    if not reset.ok:
        raise SandboxError(f"cannot empty /tests and /logs/verifier (exit {reset.exit_code}): {reset.stderr[-300:]}")
    archive = await asyncio.to_thread(tests_archive, harbor["dir"], harbor.get("tests_dir"))
    upload = await box.exec_root(["tar", "-x", "-C", "/tests", "-f", "-"], timeout_s=SETUP_TIMEOUT_S, stdin=archive)
    if not upload.ok:
        raise SandboxError(f"cannot upload tests/ to /tests (exit {upload.exit_code}): {upload.stderr[-300:]}")


async def harbor_verify(sandbox: Any, sample: dict[str, Any], agent: AgentResult, *, mode: str = "clean",
                        bounds: tuple[float, float] | None = None, outputs: list[str] | None = None,
                        egress: Allowlist | None = None, upstream: str = "", reward_key: str | None = None,
                        reward_weights: dict[str, float] | None = None, mirrors: Mirrors | None = None,
                        keep_to: Path | None = None, safe_path: bool = True) -> dict[str, Any]:
    """Run the task's tests/test.sh in `mode` (module docstring) and return the verdict. With `egress` (the
    task's verifier wants network) the tests reach the allowed hosts through an egress proxy; a failure after
    a refused host is counted as `no_network`, never a silent 0. `same` mode has no verifier egress."""
    proxy = await EgressProxy(egress, upstream=upstream or None, mirrors=mirrors).start() \
        if egress is not None and mode != "same" else None
    try:
        if proxy is not None:
            proxy.admit(getattr(sandbox, "model_peer_uid", None))
        verdict = await _verify(sandbox, sample, mode, bounds, outputs, proxy, (reward_key, reward_weights), keep_to,
                                safe_path)
    except KeptFailure as exc:
        raise _network_reason(exc, proxy) from exc
    finally:
        if proxy is not None:
            await proxy.close()
    refused = dict(proxy.stats.refused) if proxy is not None else {}
    if refused:
        verdict["network_refused"] = refused
        low = (bounds or _task_range(sample["harbor"]))[0]
        if verdict["reward"] <= low:
            raise KeptFailure("no_network", f"test.sh scored {verdict['reward']:g} after its egress refused "
                                            f"{sorted(refused)} (grant them with --egress-verifier)", verdict)
    return verdict


def _network_reason(exc: KeptFailure, proxy: EgressProxy | None) -> KeptFailure:
    """A kept failure after refused hosts is counted as `no_network` (the operator's grant, not the answer)."""
    refused = dict(proxy.stats.refused) if proxy is not None else {}
    if not refused:
        return exc
    details = {**(exc.details or {}), "network_refused": refused, "failure": exc.error_type}
    return KeptFailure("no_network", f"{exc} (its egress refused {sorted(refused)}: grant them with "
                                     "--egress-verifier)", details)


async def _verify(sandbox: Any, sample: dict[str, Any], mode: str, bounds: tuple[float, float] | None,
                  outputs: list[str] | None, proxy: EgressProxy | None,
                  choice: tuple[str | None, dict[str, float] | None] = (None, None),
                  keep_to: Path | None = None, safe_path: bool = True) -> dict[str, Any]:
    harbor = sample["harbor"]
    if getattr(sandbox, "exec_root", None) is None:
        raise VerifierError("a Harbor task's verifier runs as root in its image: use the docker backend")
    bounds = bounds or _task_range(harbor)
    env = verifier_env(await image_env(sandbox), work=sandbox.work, task_env=harbor.get("verifier_env"),
                       safe_path=safe_path)
    timeout_s = float(harbor["verifier_timeout_sec"])
    async with verifier_box(sandbox, mode, list(outputs or []), proxy.socket_path if proxy else None) as box:
        env = {**env, **proxy_env(box.egress_url if proxy is not None else None)}
        kept: dict[str, Any] = {}
        if keep_to is not None:  # what the tests are about to see, kept for `rollout-buffer reverify`
            kept = (await keep_work(box, [sandbox.work, *(outputs or [])], keep_to) if mode == "clean" else
                    {"work_products": None, "work_products_dropped": f"kept in clean mode only, not {mode}"})
        await _setup(box, harbor)
        started = time.monotonic()
        try:  # from here on, what happens is the tests' (and so the agent's work's) doing
            run = await box.exec_root([*env_argv(env), "bash", "/tests/test.sh"], timeout_s=timeout_s)
            read = await box.exec_root(["sh", "-c", _READ], timeout_s=SETUP_TIMEOUT_S)
        except SandboxError as exc:
            if not await engine_answers(sandbox):
                raise
            raise KeptFailure("verifier_killed", f"the verifier's container died while test.sh ran: {exc}",
                              {"mode": mode}) from exc
    elapsed = time.monotonic() - started
    # `timeout` answers 124 at the deadline, 137 when it had to kill; 137 before the deadline is a kill
    timed_out = run.exit_code == 124 or (run.exit_code == 137 and elapsed >= timeout_s)
    info = {"mode": mode, **kept, "test_exit_code": run.exit_code, "test_timed_out": timed_out,
            "test_stdout_tail": run.stdout[-TAIL_CHARS:], "test_stderr_tail": run.stderr[-TAIL_CHARS:]}
    if not safe_path:  # the record says its tests ran with Harbor's sys.path (agent.verify.python_safe_path)
        info["python_safe_path"] = False
    tails = f"; test.sh exit {run.exit_code}; stdout tail: {run.stdout[-600:]!r}; stderr tail: {run.stderr[-600:]!r}"
    if timed_out:
        raise KeptFailure("verifier_timeout", f"test.sh ran past its timeout_sec {timeout_s:g}{tails}", info)
    kind, _, text = read.stdout.partition("\n")
    try:
        verdict = parse_reward(kind.strip() if read.ok else "none", text, bounds, *choice)
    except KeptFailure as exc:
        kind_of = "verifier_killed" if exc.error_type == "reward_missing" and run.exit_code >= 128 else exc.error_type
        raise KeptFailure(kind_of, f"{exc}{tails}", info) from exc
    return {**verdict, **info}
