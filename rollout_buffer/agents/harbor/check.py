"""`rollout-buffer tasks check DIR`: find a broken Harbor task before training does.

Every task folder is parsed as a run would parse it; with `--pull` each image a task names is pulled when the
Engine lacks it (never built: one line per image, a failure naming it); with `--build` each task's image is
found, pulled or built (as a rollout would, cached by content hash; a build reaches the `--egress-build` hosts
only, as a run's); the USER column says who the agent runs
as (the run's `--user`, else the task's `[agent] user`, else the image's USER, else root, as in Harbor); with
`--solutions` the task's `solution/` is uploaded to `/solution` in a fresh container of its image (no network, the task's limits), `bash /solution/solve.sh` runs as the
agent user would run, and the task's own verifier scores it: a sound task scores 1. It is scored under the
`clean` verify mode first, then `snapshot`, then both without `PYTHONSAFEPATH` (`agent.verify.python_safe_path`),
then `same`: the MODE column is the safest way in which the solution scores 1, the one to run the task with
(`agent.verify.tasks`; `clean/no-safe-path` for a task that scores 1 only with Harbor's own `sys.path`);
`--verify-mode MODE` scores under that one mode instead. A task whose tests run code from
the work folder as root (`agents/verify/lint.py`) is warned about: no mode makes that code harmless. One row per task; the
exit status is 1 when any task failed a check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_buffer.agents.docker_engine import image_exists
from rollout_buffer.agents.egress import Allowlist, EgressConfigError, Mirrors, upstream_address
from rollout_buffer.agents.harbor.build_net import BuildEgress
from rollout_buffer.agents.harbor.images import Recipe, ensure_image, folder_tar, image_user, task_image
from rollout_buffer.agents.harbor.network import phase_allowlist
from rollout_buffer.agents.harbor.plan import compose_variables, harbor_options
from rollout_buffer.agents.harbor.verify import harbor_verify
from rollout_buffer.agents.sandbox import Limits, SandboxError, open_sandbox
from rollout_buffer.agents.verifiers import AgentResult, VerifierError
from rollout_buffer.agents.verify.lint import runs_work_code
from rollout_buffer.agents.verify.policy import MODES, PolicyError, VerifyPolicy, parse_policy
from rollout_buffer.agents.verify.reward import KeptFailure
from rollout_buffer.tasks.harbor import HarborTaskError, dataset_entries, read_task
from rollout_buffer.tasks.harbor_compose import ComposeError, read_compose
from rollout_buffer.tasks.harbor_network import network_warnings
from rollout_buffer.tasks.harbor_toml import TaskLimits


@dataclass
class Row:
    """One task's checks: a short word per column, and every problem and warning in full (`report`)."""

    task: str
    parsed: str = "ok"
    image: str = "-"
    user: str = "-"  # the agent's user: task.toml's [agent] user, else the image's USER, else root (Harbor's)
    solution: str = "-"
    mode: str = "-"
    ok: bool = True
    problems: list[dict[str, str]] = field(default_factory=list)  # {"field", "message"}: why the task is broken
    warnings: list[dict[str, str]] = field(default_factory=list)  # what it asks for that is not honoured here
    pulls: list[dict[str, str]] = field(default_factory=list)  # --pull: {"image", "result"}: pulled, present, failed

    def fail(self, column: str, message: str, where: str | None = None) -> None:
        setattr(self, column, "failed")
        self.problems.append({"field": where or column, "message": message})
        self.ok = False


async def run_solution(sample: dict[str, Any], options: dict[str, Any], network: Network | None = None,
                       policy: VerifyPolicy | None = None, verify_mode: str | None = None) -> dict[str, Any]:
    """The task's reference solution in a fresh container of its image, scored by its verifier (with the
    verifier's egress `network` grants, as a run's, and the reward a run's `policy` picks of several);
    `verify_mode`: under that mode only (`--verify-mode`), with the policy's `python_safe_path`."""
    policy = policy or VerifyPolicy()
    network = network or Network()
    harbor = sample["harbor"]
    limits = Limits(cpus=float(harbor["cpus"]), memory_bytes=int(harbor["memory_mb"]) << 20,
                    disk_mb=int(harbor["storage_mb"]))
    box: Any = await open_sandbox("docker", name=f"check-{harbor['name']}", limits=limits,
                                  options=await harbor_options(sample, options, build_egress=network.build_egress))
    try:
        data = await asyncio.to_thread(folder_tar, Path(harbor["dir"]) / "solution")
        up = await box.exec_root(["sh", "-c", "rm -rf /solution && mkdir -p /solution && tar -x -C /solution -f - "
                                              "&& chmod -R a+rX /solution"], timeout_s=120, stdin=data)
        if not up.ok:
            raise SandboxError(f"cannot upload solution/ (exit {up.exit_code}): {up.stderr[-300:]}")
        run = await box.exec(["bash", "/solution/solve.sh"], timeout_s=float(harbor["agent_timeout_sec"]),
                             env=dict(harbor.get("solution_env") or {}))  # [environment.env] and [solution.env]
        agent = AgentResult(exit_code=run.exit_code, stdout=run.stdout, stderr=run.stderr, timed_out=run.timed_out,
                            duration_s=run.duration_s)
        results: dict[str, Any] = {}
        if verify_mode is not None:
            tries = [(verify_mode, policy.safe_path_for(str(harbor["name"])))]
        else:  # the safest way in which it scores 1: clean, snapshot, the two without PYTHONSAFEPATH (Harbor's
            # sys.path: agent.verify.python_safe_path false), same last (it changes the container)
            tries = [(mode, safe) for safe in (True, False) for mode in ("clean", "snapshot")] + [("same", True)]
        for mode, safe in tries:
            try:
                verdict = await harbor_verify(box, sample, agent, mode=mode, outputs=harbor.get("outputs"),
                                              egress=phase_allowlist(harbor, "verifier", network.egress),
                                              upstream=network.proxy, mirrors=Mirrors.parse(network.mirrors),
                                              safe_path=safe, reward_key=policy.reward_key,
                                              reward_weights=policy.reward_weights)
            except KeptFailure as exc:
                if exc.error_type == "no_network":  # the grant, not the mode: no other mode reaches more
                    raise
                results.setdefault(mode, exc)
                continue
            if verdict["reward"] == 1.0:
                return verdict
            results.setdefault(mode, verdict)
        first = results[tries[0][0]]
        if isinstance(first, KeptFailure):
            raise first
        return first
    finally:
        await box.cleanup()


@dataclass(frozen=True)
class Network:
    """The egress `tasks check` grants a task's verifier and its image build, as `serve` does (`--egress-verifier`,
    `--egress-build`, `--egress-mirror`, `--egress-proxy`)."""

    verifier: tuple[str, ...] = ()
    mirrors: tuple[str, ...] = ()
    proxy: str = ""
    build: tuple[str, ...] = ()

    @property
    def build_egress(self) -> BuildEgress | None:
        return BuildEgress(self.build, self.mirrors, self.proxy) if self.build else None

    @property
    def egress(self) -> dict[str, tuple[str, ...]]:
        return {"verifier": self.verifier}


def _user(task_user: str | None, run_user: str | None, image_user: str | None = None) -> str:
    """Who the agent runs as: the run's `user`, else the task's, else the image's USER (known once the image
    is), else root."""
    chosen = run_user or task_user or image_user
    if chosen:
        return "root" if str(chosen).partition(":")[0] in ("0", "root") else str(chosen)
    return "root" if image_user is not None else "USER|root"  # the image's USER, once the image is known


async def pull_images(row: Row, harbor: dict[str, Any], options: dict[str, Any]) -> None:
    """`--pull`: every image the task names (its `docker_image`, its compose services' `image`) pulled when the
    Engine lacks it, never built; one entry per image, a failure naming it."""
    names = [harbor["docker_image"]] if harbor.get("docker_image") else []
    try:
        group = read_compose(Path(harbor["dir"]) / "environment", compose_variables(harbor, names[0] if names
                                                                                      else "main"))
    except ComposeError as exc:
        row.fail("image", str(exc))
        return
    names += [s.image for s in (group.sidecars if group else []) if s.image and s.build_context is None]
    if not names:
        row.image = "build-only"
        row.warnings.append({"field": "image", "message": "names no image to pull: it is built from environment/ "
                                                           "(tasks check --build)"})
        return
    for name in names:
        try:
            present = await image_exists(name, options)
            if not present:
                await ensure_image(name, Recipe(f"harbor task {harbor['name']!r}"), options)
            row.pulls.append({"image": name, "result": "present" if present else "pulled"})
        except SandboxError as exc:
            row.pulls.append({"image": name, "result": "failed"})
            row.fail("image", str(exc), f"image {name}")
    if row.image == "-":
        row.image = names[0]
        row.user = _user(harbor.get("agent_user"), options.get("user"), await image_user(names[0], options))


async def check_dataset(dataset: str | Path, *, build: bool, solutions: bool, options: dict[str, Any],
                        limits: TaskLimits | None = None, network: Network | None = None,
                        pull: bool = False, policy: VerifyPolicy | None = None,
                        verify_mode: str | None = None) -> list[Row]:
    """One row per task folder (a link out of the dataset folder is that task's problem), every problem listed."""
    rows: list[Row] = []
    for folder, outside in dataset_entries(dataset):
        row = Row(folder.name)
        rows.append(row)
        try:
            if outside is not None:
                raise outside
            sample = read_task(folder, limits=limits)
        except HarborTaskError as exc:
            for problem in exc.problems:
                row.fail("parsed", problem.message, problem.field)
            row.warnings = [{"field": w.field, "message": w.message} for w in exc.warnings]
            row.parsed = f"{len(exc.problems)} problem(s)"
            continue
        row.warnings = [{"field": w.split(": ", 1)[0], "message": w.split(": ", 1)[-1]}
                        for w in sample["harbor"]["warnings"]]
        if solutions:  # what its verifier wants of the network and this check does not grant
            row.warnings += [{"field": "network", "message": w.split(": ", 1)[-1]} for w in network_warnings(
                sample["harbor"].get("network"), (network or Network()).egress) if "verifier" in w]
        if row.warnings:
            row.parsed = f"ok, {len(row.warnings)} warning(s)"
        row.user = _user(sample["harbor"].get("agent_user"), options.get("user"))
        if pull and not (build or solutions):
            await pull_images(row, sample["harbor"], options)
            continue
        if build or solutions:
            try:
                row.image, workdir = await task_image(sample["harbor"], options,
                                                      egress=(network or Network()).build_egress)
            except SandboxError as exc:
                row.fail("image", str(exc))
                continue
            row.user = _user(sample["harbor"].get("agent_user"), options.get("user"), await image_user(
                row.image, options))
            row.warnings += [{"field": "tests/", "message": f"its tests run code from the work folder as root: {w}"}
                             for w in runs_work_code(folder / "tests", workdir)]
        if solutions:
            if not sample["harbor"]["has_solution"]:
                row.fail("solution", "no solution/solve.sh")
                continue
            try:
                verdict = await run_solution(sample, options, network, policy, verify_mode)
            except (SandboxError, VerifierError) as exc:
                kind = f"{exc.error_type}: " if isinstance(exc, KeptFailure) else ""  # e.g. no_network
                row.fail("solution", f"error: {kind}{exc}")
                continue
            row.solution = f"reward {verdict['reward']:g}"
            row.mode = verdict["mode"] if verdict["reward"] == 1.0 else "-"
            if verdict.get("python_safe_path") is False and verdict["reward"] == 1.0:
                row.mode += "/no-safe-path"
                row.warnings.append({"field": "solution", "message": (
                    f"scores 1 only with Harbor's sys.path (no PYTHONSAFEPATH): its tests run a script of the "
                    f"work folder that imports its siblings, the agent's code as root; run it with "
                    f"agent.verify.python_safe_path {{\"{row.task}\": false}} (it scores 0 otherwise)")})
            if verdict["reward"] != 1.0:
                row.fail("solution", f"the reference solution scored {verdict['reward']:g}, not 1")
                row.solution = f"reward {verdict['reward']:g}"
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a plain text table, one line per task; every problem and warning in full below it."""
    head = ("TASK", "PARSE", "IMAGE", "USER", "SOLUTION", "MODE", "OK")
    cells = [head] + [(r.task, r.parsed, r.image, r.user, r.solution, r.mode, "yes" if r.ok else "NO") for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines + report(rows))


def report(rows: list[Row]) -> list[str]:
    """Every problem and warning of every task, one per line, never cut."""
    lines = [f"{r.task}: problem: {p['field']}: {p['message']}" for r in rows for p in r.problems]
    lines += [f"{r.task}: warning: {w['field']}: {w['message']}" for r in rows for w in r.warnings]
    lines += [f"{r.task}: pull: {p['image']}: {p['result']}" for r in rows for p in r.pulls]
    return [""] + lines if lines else []


def main(dataset: str, *, build: bool, solutions: bool, docker_host: str | None, as_json: bool = False,
         limits: TaskLimits | None = None, force_build: bool = False, network: Network | None = None,
         pull: bool = False, user: str | None = None, policy: VerifyPolicy | None = None,
         verify_mode: str | None = None, forwarder_image: str | None = None) -> int:
    options: dict[str, Any] = {"docker_host": docker_host} if docker_host else {}
    if forwarder_image:  # the verifier's and the build's forwarders run there, as serve's --forwarder-image
        options["forwarder_image"] = forwarder_image
    if force_build:
        options["force_build"] = True
    if user:
        options["user"] = user
    try:
        rows = asyncio.run(check_dataset(dataset, build=build, solutions=solutions, options=options, limits=limits,
                                         network=network, pull=pull, policy=policy, verify_mode=verify_mode))
    except (HarborTaskError, OSError) as exc:
        print(json.dumps({"error": str(exc)}) if as_json else f"tasks check: {exc}")
        return 2
    bad = sum(not r.ok for r in rows)
    if as_json:
        print(json.dumps({"tasks": [asdict(r) for r in rows], "ok": len(rows) - bad, "total": len(rows)}, indent=1))
    else:
        print(table(rows))
        print(f"{len(rows) - bad}/{len(rows)} tasks ok")
    return 1 if bad else 0


def cli_main(argv: list[str], limits: TaskLimits | None = None) -> int:
    """`rollout-buffer tasks check DIR [--build] [--solutions] [--docker-host URL] [--json]`; `limits`: the
    bounds of a task's numbers (the CLI passes the server settings' own)."""
    parser = argparse.ArgumentParser(prog="rollout-buffer tasks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check", help="parse every task (and build images, run reference solutions)")
    check.add_argument("dataset", help="a folder of Harbor task folders (or one task folder)")
    check.add_argument("--build", action="store_true",
                       help="find, pull or build each task's image (Docker Engine): warms an Engine before a run")
    check.add_argument("--pull", action="store_true",
                       help="pull each image a task names that the Engine lacks, never building: warms an Engine")
    check.add_argument("--user", help="run the solutions as this unprivileged 'uid[:gid]' (a run's sandbox option "
                                      "user); default: the task's [agent] user, the image's USER, else root")
    check.add_argument("--force-build", action="store_true",
                       help="build each image from environment/Dockerfile even where docker_image names one")
    check.add_argument("--solutions", action="store_true",
                       help="run each solution/solve.sh in its image and score it with tests/test.sh (implies --build)")
    check.add_argument("--docker-host", help="the Docker Engine (default: DOCKER_HOST, else /var/run/docker.sock)")
    check.add_argument("--json", action="store_true", help="print the rows, every problem and warning, as JSON")
    check.add_argument("--egress-verifier", action="append", default=[], metavar="HOST",
                       help="a host each task's verifier may reach through its egress proxy, as serve's (repeatable)")
    check.add_argument("--egress-build", action="append", default=[], metavar="HOST",
                       help="a host each task's image build (its Dockerfile's RUN steps) may reach through an egress "
                            "proxy, as serve's (repeatable; default: none, the build has no network)")
    check.add_argument("--egress-mirror", action="append", default=[], metavar="HOST=ADDR:PORT",
                       help="serve an allowed host from a mirror, as serve's (repeatable)")
    check.add_argument("--egress-proxy", default="", metavar="URL", help="an upstream HTTP proxy, as serve's")
    check.add_argument("--reward-key", metavar="KEY", help="the reward of a reward.json of several that a solution "
                                                           "is scored by, as a run's agent.verify.reward_key")
    check.add_argument("--reward-weights", metavar="JSON", help="weights of a reward.json's rewards, e.g. "
                       "'{\"correctness\": 1}', as a run's agent.verify.reward_weights (their weighted sum)")
    check.add_argument("--verify-mode", choices=MODES, help="score each solution under this verify mode only (the "
                       "one a run uses) instead of finding the safest in which it scores 1")
    check.add_argument("--forwarder-image", metavar="IMAGE",
                       help="an image with python3 that runs the egress forwarders, as serve's (task images then "
                            "need none)")
    args = parser.parse_args(argv)
    try:  # the same checks as a run's agent.verify
        weights = None if args.reward_weights is None else json.loads(args.reward_weights)
        policy = parse_policy({k: v for k, v in (("reward_key", args.reward_key), ("reward_weights", weights))
                               if v is not None})
    except (ValueError, PolicyError) as exc:
        parser.error(f"--reward-key/--reward-weights: {exc}")
    try:  # a bad grant is the command line's error, named, before anything runs
        Allowlist.parse([*args.egress_verifier, *args.egress_build]), Mirrors.parse(args.egress_mirror)
        upstream_address(args.egress_proxy)
    except EgressConfigError as exc:
        parser.error(str(exc))
    return main(args.dataset, build=args.build or args.force_build, solutions=args.solutions,
                docker_host=args.docker_host, as_json=args.json, limits=limits, force_build=args.force_build,
                network=Network(tuple(args.egress_verifier), tuple(args.egress_mirror), args.egress_proxy,
                                tuple(args.egress_build)),
                pull=args.pull, user=args.user, policy=policy, verify_mode=args.verify_mode,
                forwarder_image=args.forwarder_image)
