"""One chaos run: rounds of a math run trained by a real trainer while the scheduler breaks things.

Each round is a native math run (several epochs, repeats) rolled out by the buffer's worker process against
the test engine and trained by `bench.chaos.trainer` through the chaos proxy, restarted from its checkpoint
whenever it is killed or dies; beside it, a writer acknowledged by the API and a leased reader stream an
externally written run. Rounds start until `seconds` are spent; then faults stop, the last round finishes,
and `bench.chaos.checker` reads the whole history.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from bench.chaos.checker import Report, RoundHistory, check
from bench.chaos.scheduler import FaultScheduler
from bench.chaos.services import Services
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from tests.support.faults import LeasedReader, RetryingWriter, start_daemon
from tests.support.helpers import make_record, start_run, write_jsonl
from tests.support.redis_cluster import LocalRedisCluster
from tests.support.runtime_helpers import arithmetic_rows

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ChaosConfig:
    base: Path
    seconds: float = 90.0
    seed: int = 0
    cluster: bool = False
    wait_replicas: int = 0
    retain_runs: int | None = None
    prompts: int = 6
    epochs: int = 3
    repeats: int = 2
    batch: int = 2  # groups per trainer step
    external_records: int = 120
    gateway: bool = True  # agents (OpenAI SDK) through gateway sessions of an external run
    gateway_instances: int = 3
    finish_s: float = 180.0  # after the faults stop, how long the last round may take to finish
    min_gap_s: float = 0.3  # seeded gaps between faults
    max_gap_s: float = 1.5


@dataclass
class TrainerLives:
    """The trainer process of one round, restarted from its checkpoint whenever it exits unfinished."""

    workdir: Path
    config_path: Path
    proc: subprocess.Popen[bytes] | None = None
    lives: int = 0
    kills: int = 0
    crashes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def done(self) -> bool:
        return (self.workdir / "done").exists()

    def tick(self) -> None:
        """Start a life if none runs and the round is not done; note how the previous one ended."""
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                return
            if self.proc is not None and self.proc.returncode not in (0, -signal.SIGKILL):
                log = (self.workdir / f"life-{self.lives}.log").read_text(errors="replace")
                self.crashes.append(log[-1500:])
            if self.done():
                return
            self.lives += 1
            with open(self.workdir / f"life-{self.lives}.log", "wb") as log_file:
                self.proc = subprocess.Popen([sys.executable, "-m", "bench.chaos.trainer", str(self.workdir),
                                              str(self.config_path)], cwd=REPO, stdout=log_file,
                                             stderr=subprocess.STDOUT)

    def kill(self) -> bool:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                return False
            self.proc.kill()
            self.proc.wait(timeout=30)
            self.kills += 1
            return True

    def step(self) -> int:
        try:
            return int(json.loads((self.workdir / "checkpoint.json").read_text())["step"])
        except (OSError, ValueError, KeyError):
            return 0


def _trainer_config(cfg: ChaosConfig, services: Services, round_no: int, prompt_file: Path) -> dict[str, Any]:
    engine = urlparse(services.engine.url)
    return {"steps": cfg.prompts * cfg.epochs // cfg.batch, "args": {
        "rollout_buffer_url": services.proxy_url, "rollout_task_type": "math", "prompt_data": str(prompt_file),
        "n_samples_per_prompt": cfg.repeats, "rollout_batch_size": cfg.batch, "num_epoch": cfg.epochs,
        "rollout_num_process": 16, "hf_checkpoint": str(qwen_tokenizer_dir("qwen2.5")), "loss_mask_type": "qwen",
        "rollout_max_response_len": 64, "rollout_temperature": 1.0, "rollout_top_p": 1.0,
        "sglang_router_ip": engine.hostname, "sglang_router_port": engine.port, "agent_fetch_timeout_s": 15.0,
        "fetch_trajectory_retry_times": -1, "agent_fetch_backoff_s": 0.1, "agent_fetch_backoff_max_s": 1.0,
        "agent_start_rollout_attempts": 60, "agent_start_rollout_backoff_s": 0.5, "agent_lease_s": 60.0,
        "agent_rollout_run_id": f"chaos-{cfg.seed}-{round_no}", "use_wandb": False}}


def _external_stream(services: Services, base: Path, round_no: int, n: int) -> tuple[RetryingWriter, LeasedReader]:
    """A run written by a client (acknowledged writes) and read with leases, directly on the API."""
    assert services.server is not None
    input_file = write_jsonl(base / f"external-{round_no}.jsonl", [{"instance_id": f"x{i}"} for i in range(n)])
    deadline = time.monotonic() + 60
    while True:
        try:
            with httpx.Client(base_url=services.server.url, timeout=15) as client:
                run_id = start_run(client, input_file, task_type="external", repeats=1,
                                   run_id=f"external-{round_no}-{base.name}")
            break
        except (httpx.HTTPError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    records = [make_record(f"x{i}", uid=f"{run_id}-{i}", run_id=run_id) for i in range(n)]
    writer = RetryingWriter(services.server.url, run_id, records, batch_size=4, deadline_s=600)
    reader = LeasedReader(services.server.url, run_id, lease_s=60.0, deadline_s=600)
    start_daemon(writer.run)
    start_daemon(reader.run)
    return writer, reader


def run_chaos(cfg: ChaosConfig) -> Report:
    cfg.base.mkdir(parents=True, exist_ok=True)
    cluster = LocalRedisCluster(cfg.base / "cluster", replicas=1, node_timeout_ms=1000).start() if cfg.cluster else None
    services = Services(cfg.base, cluster=cluster, wait_replicas=cfg.wait_replicas, retain_runs=cfg.retain_runs)
    rounds: list[RoundHistory] = []
    current: dict[str, Any] = {}
    started = time.monotonic()
    try:
        with services.running():
            scheduler = FaultScheduler(cfg.seed, services.injectors(
                trainer_kill=lambda: current["lives"].kill() if current else False,
                run_id=lambda: current.get("run_id"),
                version=lambda: current["lives"].step() + 1 if current else 1),
                min_gap_s=cfg.min_gap_s, max_gap_s=cfg.max_gap_s)
            faults = threading.Thread(target=scheduler.run, daemon=True)
            faults.start()
            round_no = 0
            while time.monotonic() - started < cfg.seconds:
                workdir = cfg.base / f"round-{round_no}"
                workdir.mkdir()
                prompt_file = write_jsonl(workdir / "math.jsonl", arithmetic_rows(cfg.prompts, round=round_no))
                config_path = workdir / "trainer.json"
                config_path.write_text(json.dumps(_trainer_config(cfg, services, round_no, prompt_file)))
                lives = TrainerLives(workdir, config_path)
                writer, reader = _external_stream(services, workdir, round_no, cfg.external_records)
                agents = _gateway_agents(cfg, services, round_no) if cfg.gateway else None
                current.update(lives=lives, run_id=f"chaos-{cfg.seed}-{round_no}")
                finish_by = started + cfg.seconds + cfg.finish_s
                while not lives.done() and time.monotonic() < finish_by:
                    if time.monotonic() - started >= cfg.seconds:
                        scheduler.stop.set()
                    lives.tick()
                    services.sample_memory(time.monotonic() - started)
                    time.sleep(0.2)
                while len(writer.acknowledged) < len(writer.records) and time.monotonic() < finish_by:
                    time.sleep(0.1)
                reader_done = _drain(reader, writer, finish_by)
                if agents is not None:
                    agents.done.wait(max(0.0, finish_by - time.monotonic()))
                    agents.stop_reading(max(1.0, finish_by - time.monotonic()))
                if not lives.done():
                    lives.kill()
                    lives.crashes.append(_diagnosis(services, f"chaos-{cfg.seed}-{round_no}"))
                rounds.append(RoundHistory(workdir=workdir, expected={(e, r["instance_id"]) for e in range(cfg.epochs)
                                                                      for r in arithmetic_rows(cfg.prompts)},
                                           lives=lives.lives, trainer_kills=lives.kills, crashes=lives.crashes,
                                           finished=lives.done(), acknowledged=set(writer.acknowledged),
                                           read=reader.uids(), reader_done=reader_done, agents=agents))
                round_no += 1
            scheduler.stop.set()
            faults.join(timeout=120)
            return check(cfg.seed, time.monotonic() - started, scheduler, services, rounds)
    finally:
        if cluster is not None:
            cluster.stop()


def _gateway_agents(cfg: ChaosConfig, services: Services, round_no: int) -> Any:
    from bench.chaos.agents import GatewayAgents  # the openai SDK is needed only here

    assert services.server is not None
    return GatewayAgents(services.server.url, services.engine.url, str(qwen_tokenizer_dir("qwen2.5")),
                         f"gateway-{cfg.seed}-{round_no}", instances=cfg.gateway_instances, repeats=cfg.repeats,
                         deadline_s=cfg.seconds + cfg.finish_s).start()


def _drain(reader: LeasedReader, writer: RetryingWriter, finish_by: float) -> bool:
    """Let the reader take what is left of the acknowledged writes, then stop it."""
    while time.monotonic() < finish_by and len(set(reader.uids())) < len(set(writer.acknowledged)):
        time.sleep(0.1)
    reader.stop.set()
    return len(set(reader.uids())) >= len(set(writer.acknowledged))


def _diagnosis(services: Services, run_prefix: str) -> str:
    """What the buffer says about an unfinished round's runs (every generation), for the report."""
    assert services.server is not None
    try:
        with httpx.Client(base_url=services.server.url, timeout=10) as client:
            runs = [str(r) for r in client.get("/runs").json().get("runs", []) if str(r).startswith(run_prefix)]
            details = [client.get(f"/runs/{run_id}").json() for run_id in runs]
    except (httpx.HTTPError, ValueError) as exc:
        return f"no diagnosis: {exc}"
    return json.dumps(details)[:3000]
