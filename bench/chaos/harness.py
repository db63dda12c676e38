"""One chaos run: rounds of a math run trained by a real trainer while the scheduler breaks things.

Each round is a native math run (several epochs, repeats) rolled out by the buffer's worker processes against
the test engine and trained by `bench.chaos.trainer` through the chaos proxy, restarted from its checkpoint
whenever it is killed or dies; beside it, a writer acknowledged by the API and a leased reader stream an
externally written run. Once a round's trainer is done the next round starts at once (the finished round's
writer, reader and agents finish in the background); rounds start until `seconds` are spent; then faults
stop, the last round finishes, and `bench.chaos.checker` reads the whole history.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from bench.chaos.checker import Report, RoundHistory, check
from bench.chaos.forkserver import ForkServer, alive
from bench.chaos.trainer import IN_STEP, STEPS
from bench.chaos.scheduler import FaultScheduler
from bench.chaos.services import SESSION_TIMEOUT_S, Services
from bench.chaos.stress import Stress
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from tests.support.faults import LeasedReader, RetryingWriter, start_daemon
from tests.support.helpers import make_record, start_run, write_jsonl
from tests.support.process_tools import wait_for
from tests.support.redis_cluster import LocalRedisCluster
from tests.support.runtime_helpers import arithmetic_rows


# failover (a replica noticing its primary silent, then elected) plus the rejoin fit in about 2 s
CLUSTER_NODE_TIMEOUT_MS = 500
ARMED_GAP = 0.6  # proxy and engine faults wait for a request to take them: armed at 0.6x the gaps
TRAINER_GAP = 0.3  # the trainer waits for its next checkpoint between kills: tried at 0.3x the gaps
STUCK_S = 10.0  # a trainer life in one step this long may be killed even at the checkpoint of the last kill
ENGINE_CALL_TIMEOUT_S = 1.0  # the runs' limit on one engine call (a hang is retried after it)
MAX_TASK_ATTEMPTS = 20
WARM_UP_S = 120.0  # faults start at the first trained step, or after this long


@dataclass
class ChaosConfig:
    base: Path
    seconds: float = 90.0
    seed: int = 0
    cluster: bool = False
    wait_replicas: int = 0
    retain_runs: int | None = None
    prompts: int = 8
    epochs: int = 6
    repeats: int = 2
    batch: int = 2  # groups per trainer step
    train_s: float = 0.3  # a step's training time: the window in which a killed trainer holds a leased batch
    skip_checkpoint_p: float = 0.05  # steps not followed by a checkpoint (slime's --save-interval)
    external_records: int = 120
    gateway: bool = True  # agents (OpenAI SDK) through gateway sessions of an external run
    gateway_instances: int = 3  # at least this many instances (a group of `repeats` sessions each) per round
    agent_loops: int = 8  # gateway agents at once, opening sessions for as long as the round's trainer trains
    finish_s: float = 180.0  # after the faults stop, how long the last round may take to finish
    min_gap_s: float = 0.8  # seeded gaps between faults of one kind (every kind on its own thread)
    max_gap_s: float = 3.6
    kinds: set[str] | None = None  # only these fault kinds (default: every kind), to narrow a failure down
    stress: int = 0  # busy processes beside the run (`bench.chaos.stress`): a busy machine, as training runs on
    # the server's --session-timeout-s: shorter, and the idle sweep races agents' turns and finishes all the time
    session_timeout_s: float = SESSION_TIMEOUT_S

    def __post_init__(self) -> None:
        # the trainer trains prompts * epochs // batch steps: a remainder would be groups no step takes, which
        # the checker would report as lost, a configuration error made to look like a violation
        if min(self.prompts, self.epochs, self.batch, self.repeats) < 1 or (self.prompts * self.epochs) % self.batch:
            raise ValueError(f"chaos: prompts * epochs ({self.prompts} * {self.epochs}) must be a multiple of batch "
                             f"({self.batch}), and each of them at least 1")


@dataclass
class TrainerLives:
    """The trainer process of one round (a fork-server child), started again from its checkpoint whenever
    it is killed or exits unfinished."""

    workdir: Path
    config_path: Path
    forks: ForkServer
    pid: int | None = None
    killed: bool = False
    killed_at_step: int = -1  # the checkpoint the trainer was at when last killed
    lives: int = 0
    kills: int = 0
    crashes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def done(self) -> bool:
        return (self.workdir / "done").exists()

    def tick(self) -> None:
        """Start a life if none runs and the round is not done; note how the previous one ended."""
        with self.lock:
            if self.pid is not None and alive(self.pid):
                return
            if self.pid is not None and not self.killed and not self.done():
                log = (self.workdir / f"life-{self.lives}.log").read_text(errors="replace")
                self.crashes.append(log[-1500:])  # it exited unfinished without being killed
            if self.done():
                return
            self.lives += 1
            self.killed = False
            self.pid = self.forks.spawn("trainer", [str(self.workdir), str(self.config_path)],
                                        self.workdir / f"life-{self.lives}.log")

    def step(self) -> int:
        try:
            return int(json.loads((self.workdir / "checkpoint.json").read_text())["step"])
        except (OSError, ValueError, KeyError):
            return 0

    def mid_step(self) -> bool:
        """Whether the running life is mid-step, and the trainer checkpointed since the last kill. A
        schedule that killed every life before its first checkpoint would stop the run for good (each life
        starts again from the same checkpoint), which no real preemption rate does: a trainer is never
        killed twice at the same checkpoint unless the life has been stuck in its step for `STUCK_S`."""
        path = self.workdir / IN_STEP
        try:
            pid, _step, _first = path.read_text().split()
            stuck = time.time() - path.stat().st_mtime > STUCK_S
        except (OSError, ValueError):
            return False
        # a life stuck in one step that long is killed all the same
        return pid == str(self.pid) and (self.step() > self.killed_at_step or stuck)

    def kill(self, force: bool = False) -> bool:
        """SIGKILL the trainer mid-step (False while no life runs or the running one is in its first step,
        unless `force`: a round out of time)."""
        with self.lock:
            if self.pid is None or not alive(self.pid) or self.done() or not (force or self.mid_step()):
                return False
            os.kill(self.pid, signal.SIGKILL)
            self.killed = True
            self.killed_at_step = self.step()
            wait_for(lambda: not alive(self.pid), 30, "the killed trainer gone")  # type: ignore[arg-type]
            self.kills += 1
            with open(self.workdir / "kills.log", "a") as log:  # when each life ended, for the timeline
                log.write(f"{time.time():.3f} {self.killed_at_step}\n")
        if not force:
            self.tick()  # restarted from its checkpoint at once, as a preempted job rescheduled
        return True

@dataclass
class FaultClock:
    """When faults land: from the trainer's first trained step (the buffer in its steady state, its run's
    tokenizer checked once) for `seconds`, or from `WARM_UP_S` after the start if no step was trained by
    then; the last round then has `finish_s` to finish."""

    scheduler: FaultScheduler
    seconds: float
    finish_s: float
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    thread: threading.Thread | None = None

    def tick(self, trained: bool) -> None:
        if self.started is None and (trained or time.monotonic() - self.created > WARM_UP_S):
            self.started = time.monotonic()
            self.thread = threading.Thread(target=self.scheduler.run, daemon=True)
            self.thread.start()
        if self.elapsed() >= self.seconds:
            self.scheduler.stop.set()

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def over(self) -> bool:
        return self.started is not None and self.elapsed() >= self.seconds

    def finish_by(self) -> float:
        return (self.started or self.created + WARM_UP_S) + self.seconds + self.finish_s

    def stop(self) -> None:
        self.scheduler.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=120)


def _trainer_config(cfg: ChaosConfig, services: Services, round_no: int, prompt_file: Path) -> dict[str, Any]:
    engine = urlparse(services.engine.url)
    steps = cfg.prompts * cfg.epochs // cfg.batch
    return {"steps": steps, "train_s": cfg.train_s, "seed": f"{cfg.seed}/{round_no}",
            "skip_checkpoint_p": cfg.skip_checkpoint_p, "args": {
        "rollout_buffer_url": services.proxy_url, "rollout_task_type": "math", "prompt_data": str(prompt_file),
        "n_samples_per_prompt": cfg.repeats, "rollout_batch_size": cfg.batch, "num_epoch": cfg.epochs,
        "rollout_num_process": 16, "hf_checkpoint": str(qwen_tokenizer_dir("qwen2.5")), "loss_mask_type": "qwen",
        "rollout_max_response_len": 64, "rollout_temperature": 1.0, "rollout_top_p": 1.0,
        "sglang_router_ip": engine.hostname, "sglang_router_port": engine.port, "agent_fetch_timeout_s": 15.0,
        "fetch_trajectory_retry_times": -1, "agent_fetch_backoff_s": 0.1, "agent_fetch_backoff_max_s": 0.3,
        # a preemptible trainer's settings: retry a buffer that restarts every few seconds at once, and a
        # short lease (renewed every third of it while a step runs) so a killed life's batch returns quickly
        "agent_start_rollout_attempts": 200, "agent_start_rollout_backoff_s": 0.05, "agent_lease_s": 3.0,
        "agent_rollout_run_id": f"chaos-{cfg.seed}-{round_no}", "use_wandb": False, "num_rollout": steps,
        # a preemptible deployment's run options: a hung engine call is given up after 1 s and retried
        # (within the rollout's ROLLOUT_TIMEOUT_S); a rollout whose worker is killed under it is delivered
        # again up to MAX_TASK_ATTEMPTS times (the default 3 guards against a task that kills its workers,
        # and would fail rollouts here whose workers a kill every ~2 s took down three times)
        "agent_start_options": {"engine_timeout_s": ENGINE_CALL_TIMEOUT_S, "max_task_attempts": MAX_TASK_ATTEMPTS}}}


def _external_stream(services: Services, base: Path, round_no: int, n: int) -> tuple[RetryingWriter, LeasedReader]:
    """A run written by a client (acknowledged writes) and read with leases, directly on the API."""
    input_file = write_jsonl(base / f"external-{round_no}.jsonl", [{"instance_id": f"x{i}"} for i in range(n)])
    deadline = time.monotonic() + 60
    while True:
        try:
            with httpx.Client(base_url=services.url, timeout=15) as client:
                run_id = start_run(client, input_file, task_type="external", repeats=1,
                                   run_id=f"external-{round_no}-{base.name}")
            break
        except (httpx.HTTPError, AssertionError):
            if time.monotonic() > deadline:
                raise
            services.supervise()  # this loop holds the harness's own: an API that exited is started again here
            time.sleep(0.2)
    records = [make_record(f"x{i}", uid=f"{run_id}-{i}", run_id=run_id) for i in range(n)]
    writer = RetryingWriter(services.url, run_id, records, batch_size=4, deadline_s=600)
    reader = LeasedReader(services.url, run_id, lease_s=60.0, deadline_s=600)
    start_daemon(writer.run)
    start_daemon(reader.run)
    return writer, reader


def run_chaos(cfg: ChaosConfig) -> Report:
    """One chaos run (under `cfg.stress` busy processes, stopped at its end); the checker's report."""
    with Stress(cfg.stress) as stress:
        report = _run_chaos(cfg)
    report.load = {"busy processes (--stress)": float(cfg.stress), **stress.summary()}
    return report


def _run_chaos(cfg: ChaosConfig) -> Report:
    cfg.base.mkdir(parents=True, exist_ok=True)
    cluster = None
    if cfg.cluster:
        cluster = LocalRedisCluster(cfg.base / "cluster", replicas=1, node_timeout_ms=CLUSTER_NODE_TIMEOUT_MS).start()
    services = Services(cfg.base, cluster=cluster, wait_replicas=cfg.wait_replicas, retain_runs=cfg.retain_runs,
                        session_timeout_s=cfg.session_timeout_s,
                        primary_rng=random.Random(f"{cfg.seed}/primary"))
    current: dict[str, Any] = {}
    try:
        with services.running():
            injectors = services.injectors(
                trainer_kill=lambda: current["lives"].kill() if current else False,
                run_id=lambda: current.get("run_id"),
                version=lambda: current["lives"].step() + 1 if current else 1)
            if cfg.kinds is not None:
                injectors = {kind: inject for kind, inject in injectors.items() if kind in cfg.kinds}
            armed = {kind: (cfg.min_gap_s * ARMED_GAP, cfg.max_gap_s * ARMED_GAP) for kind in injectors
                     if kind.startswith(("proxy_", "engine_"))}
            # a trainer is killed only once it checkpointed since its last kill: tried sooner, so the kills
            # keep up with the trainer's own pace
            armed["trainer_kill"] = (cfg.min_gap_s * TRAINER_GAP, cfg.max_gap_s * TRAINER_GAP)
            scheduler = FaultScheduler(cfg.seed, injectors, min_gap_s=cfg.min_gap_s, max_gap_s=cfg.max_gap_s,
                                       gap_s=armed)
            clock = FaultClock(scheduler, cfg.seconds, cfg.finish_s)
            rounds = [_start_round(cfg, services, 0)]
            while time.monotonic() < clock.finish_by():
                latest = rounds[-1]
                current.update(lives=latest.lives, run_id=f"chaos-{cfg.seed}-{latest.no}")
                clock.tick(trained=(rounds[0].workdir / STEPS).exists())
                if clock.started is not None and latest.agents is not None:
                    latest.agents.begin.set()
                for rnd in rounds:  # a round's agents stop opening sessions once its trainer is done
                    if rnd.agents is not None and (clock.over() or rnd.lives.done()):
                        rnd.agents.enough.set()
                latest.lives.tick()
                services.supervise()
                services.sample_memory(clock.elapsed())
                if latest.lives.done():
                    if clock.over():
                        break
                    # the trainer goes on at once; the round's writer, reader and agents finish in the background
                    rounds.append(_start_round(cfg, services, latest.no + 1))
                    continue
                time.sleep(0.2)
            clock.stop()
            for rnd in rounds:
                if rnd.agents is not None:
                    rnd.agents.enough.set()
            histories = [_finish_round(cfg, services, r, clock.finish_by()) for r in rounds]
            return check(cfg.seed, clock.elapsed(), scheduler, services, histories, fault_s=cfg.seconds)
    finally:
        if cluster is not None:
            cluster.stop()


@dataclass
class Round:
    """One round in flight: its trainer, its externally written run and its gateway agents."""

    no: int
    workdir: Path
    lives: TrainerLives
    writer: RetryingWriter
    reader: LeasedReader
    agents: Any


def _start_round(cfg: ChaosConfig, services: Services, round_no: int) -> Round:
    workdir = cfg.base / f"round-{round_no}"
    workdir.mkdir()
    prompt_file = write_jsonl(workdir / "math.jsonl", arithmetic_rows(cfg.prompts, round=round_no))
    config_path = workdir / "trainer.json"
    config_path.write_text(json.dumps(_trainer_config(cfg, services, round_no, prompt_file)))
    assert services.forks is not None
    lives = TrainerLives(workdir, config_path, services.forks)
    writer, reader = _external_stream(services, workdir, round_no, cfg.external_records)
    agents = _gateway_agents(cfg, services, round_no) if cfg.gateway else None
    return Round(round_no, workdir, lives, writer, reader, agents)


def _finish_round(cfg: ChaosConfig, services: Services, rnd: Round, finish_by: float) -> RoundHistory:
    """Wait (until `finish_by`) for what the round's writer, reader and agents have left, then its history."""
    writer, reader, agents, lives = rnd.writer, rnd.reader, rnd.agents, rnd.lives
    while len(writer.acknowledged) < len(writer.records) and time.monotonic() < finish_by:
        time.sleep(0.1)
    reader_done = _drain(reader, writer, finish_by)
    if agents is not None:
        agents.done.wait(max(0.0, finish_by - time.monotonic()))
        if not agents.stop_reading(max(1.0, finish_by - time.monotonic())):
            agents.diagnosis = _diagnosis(services, agents.run_id)
    if not lives.done():
        lives.kill(force=True)
        lives.crashes.append(_diagnosis(services, f"chaos-{cfg.seed}-{rnd.no}"))
    return RoundHistory(workdir=rnd.workdir, expected={(e, r["instance_id"]) for e in range(cfg.epochs)
                                                       for r in arithmetic_rows(cfg.prompts)},
                        lives=lives.lives, trainer_kills=lives.kills, crashes=lives.crashes, finished=lives.done(),
                        acknowledged=set(writer.acknowledged), read=reader.uids(), reader_done=reader_done,
                        agents=agents)


def _gateway_agents(cfg: ChaosConfig, services: Services, round_no: int) -> Any:
    from bench.chaos.agents import GatewayAgents  # the openai SDK is needed only here

    return GatewayAgents(services.proxy_url, services.engine.url, str(qwen_tokenizer_dir("qwen2.5")),
                         f"gateway-{cfg.seed}-{round_no}", instances=cfg.gateway_instances, repeats=cfg.repeats,
                         engine_timeout_s=ENGINE_CALL_TIMEOUT_S, loops=cfg.agent_loops,
                         deadline_s=WARM_UP_S + cfg.seconds + cfg.finish_s).start()  # faults may start late


def _drain(reader: LeasedReader, writer: RetryingWriter, finish_by: float) -> bool:
    """Let the reader take what is left of the acknowledged writes, then stop it."""
    while time.monotonic() < finish_by and len(set(reader.uids())) < len(set(writer.acknowledged)):
        time.sleep(0.1)
    reader.stop.set()
    return len(set(reader.uids())) >= len(set(writer.acknowledged))


def _diagnosis(services: Services, run_prefix: str) -> str:
    """What the buffer says about an unfinished round's runs (every generation), for the report."""
    try:
        with httpx.Client(base_url=services.url, timeout=10) as client:
            runs = [str(r) for r in client.get("/runs").json().get("runs", []) if str(r).startswith(run_prefix)]
            details = [client.get(f"/runs/{run_id}").json() for run_id in runs]
    except (httpx.HTTPError, ValueError) as exc:
        return f"no diagnosis: {exc}"
    return json.dumps(details)[:3000]
