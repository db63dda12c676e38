"""Harbor rollouts re-verified from their kept work products (`rollout-buffer reverify --harbor-tasks DIR`).

For each archived record of a run that kept them (`agent.verify.keep_work`): the task folder named by the
record's `instance_id` is read from `DIR` as a run reads it; a fresh container of the task's image (found or
built as a rollout's, its limits, no network, no model) gets the work products back (each checked against
its digest: one altered after the rollout is refused), and the task's tests run on them exactly as the
`clean` verify mode runs them (with the rollout's `python_safe_path`, and the network the command grants, as a
run's verifier: `--egress-verifier`, `--egress-mirror`, `--egress-proxy`; a refusal is a counted `no_network`): in a second fresh container holding only the work folder and the outputs,
with `tests/` uploaded now (`--tests`: another folder in its place). The verdict is the new reward version's
detail. A record without kept work products, or whose task folder is missing, or whose tests gave no valid
reward (a kept failure: timed out, no reward file) is counted failed, its reward kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_buffer.agents.egress import Allowlist, Mirrors, upstream_address
from rollout_buffer.agents.harbor.network import phase_allowlist
from rollout_buffer.agents.harbor.plan import harbor_options
from rollout_buffer.agents.harbor.verify import harbor_verify
from rollout_buffer.agents.sandbox import Limits, open_sandbox
from rollout_buffer.agents.verifiers import AgentResult
from rollout_buffer.agents.verify.keep import WORK_FOLDER, restore_work
from rollout_buffer.agents.verify.reward import KeptFailure
from rollout_buffer.tasks.harbor import read_task

RewardFn = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def tests_for(tests: Path | None, task: str) -> Path | None:
    """`--tests DIR`: a `tests/` folder itself (it has test.sh) for every task, or one per task in DIR/<task>/
    (or DIR/<task>/tests/); None: the task's own."""
    if tests is None:
        return None
    if (tests / "test.sh").is_file():
        return tests
    for candidate in (tests / task / "tests", tests / task):
        if (candidate / "test.sh").is_file():
            return candidate
    return None


@dataclass(frozen=True)
class ReverifyNetwork:
    """What the re-run tests may reach, as a run's verifier (`--egress-verifier`, `--egress-mirror`,
    `--egress-proxy`), within what each task asks; nothing by default."""

    hosts: tuple[str, ...] = ()
    mirrors: Mirrors | None = None
    upstream: str = ""

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> ReverifyNetwork:
        """From the CLI's `network` dict; EgressConfigError (a ValueError) naming a bad grant."""
        raw = raw or {}
        hosts, upstream = tuple(raw.get("verifier") or ()), str(raw.get("proxy") or "")
        Allowlist.parse(hosts)
        upstream_address(upstream)
        return cls(hosts, Mirrors.parse(tuple(raw.get("mirrors") or ())), upstream)


def harbor_reward(archive: Path, tasks: Path, *, tests: Path | None = None, options: dict[str, Any] | None = None,
                  concurrency: int = 2, network: dict[str, Any] | None = None) -> RewardFn:
    """The reward function `rollout_buffer.archive.reverify` runs over `archive` (the run's folder); `network`:
    the tests' egress grants (`ReverifyNetwork.parse`: a bad one raises here, before any record)."""
    grants = ReverifyNetwork.parse(network)
    store = Path(archive) / WORK_FOLDER
    slots: dict[Any, asyncio.Semaphore] = {}  # per event loop (reverify runs one per shard): records at once
    docker = dict(options or {})

    async def reward(record: dict[str, Any]) -> dict[str, Any]:
        verdict = (record.get("extra_info") or {}).get("verifier") or {}
        products = verdict.get("work_products")
        if not isinstance(products, dict) or not products:
            raise ValueError(verdict.get("work_products_dropped") or "the rollout kept no work products "
                             "(agent.verify.keep_work, clean mode)")
        name = str(record["instance_id"])
        folder = (tasks / name).resolve()
        if folder.parent != tasks.resolve() or not folder.is_dir():
            raise ValueError(f"no task folder {name!r} in {tasks}")
        sample = await asyncio.to_thread(read_task, folder)
        harbor = sample["harbor"]
        harbor["tests_dir"] = str(tests_for(tests, name) or folder / "tests")
        async with slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(concurrency)):
            # the tests run with the sys.path the rollout's did (agent.verify.python_safe_path)
            return await _verify(sample, products, store, docker, grants, verdict.get("python_safe_path") is not False)

    return reward


async def _verify(sample: dict[str, Any], products: dict[str, Any], store: Path, options: dict[str, Any],
                  grants: ReverifyNetwork, safe_path: bool) -> dict[str, Any]:
    harbor = sample["harbor"]
    limits = Limits(cpus=float(harbor["cpus"]), memory_bytes=int(harbor["memory_mb"]) << 20,
                    disk_mb=int(harbor["storage_mb"]))
    box: Any = await open_sandbox("docker", name=f"reverify-{harbor['name']}", limits=limits,
                                  options=await harbor_options(sample, options))
    try:
        await restore_work(box, products, store)
        outputs = [path for path in products if path != box.work]
        agent = AgentResult(exit_code=0, stdout="", stderr="", timed_out=False, duration_s=0.0)
        try:
            return await harbor_verify(box, sample, agent, mode="clean", outputs=outputs, safe_path=safe_path,
                                       egress=phase_allowlist(harbor, "verifier", {"verifier": grants.hosts}),
                                       upstream=grants.upstream, mirrors=grants.mirrors)
        except KeptFailure as exc:  # test.sh gave no valid reward: counted failed, never a silent 0
            raise ValueError(f"{exc.error_type}: {exc}") from exc
    finally:
        await box.cleanup()
