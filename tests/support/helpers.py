"""Test helpers: a real `rollout-buffer serve` process on loopback, and record builders."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]


def input_roots_for_tests() -> str:
    """`ROLLOUT_BUFFER_INPUT_ROOT` for test servers: the repository, the temp dir (pytest's tmp paths) and
    the test tokenizers' cache, where the tests' input files and tokenizer paths live."""
    from rollout_buffer.testing.tokenizer import tokenizer_cache_root

    return os.pathsep.join([str(REPO), tempfile.gettempdir(), str(tokenizer_cache_root())])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ServerSpec:
    """How a test module's buffer server starts (the `server` fixture of tests/conftest.py reads the
    module's `SERVER`): `rollout-buffer serve` flags and environment, the Redis backends it runs on (once
    per backend; a `variants` entry is a further run on the embedded Redis with flags of its own), task
    modules written to a folder of their own (file name -> source), and, for a module whose server must
    start in a folder of its own, the fixture that gives that folder (`cwd_fixture`, read at `cwd_key`)
    with the data dir relative to it. `shared` names a session-wide server fixture to use instead of
    starting one."""

    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    backends: tuple[str, ...] = ("embedded",)
    variants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    task_files: dict[str, str] = field(default_factory=dict)
    cwd_fixture: str | None = None
    cwd_key: str = "root"
    data_dir: str = "data"
    shared: str | None = None  # a session-wide server fixture the module uses instead of one of its own


class ServerProcess:
    """`python -m rollout_buffer.cli serve` in a child process, with its own data dir and port. Its input
    roots are `input_roots_for_tests()` unless `env` (or the environment) sets `ROLLOUT_BUFFER_INPUT_ROOT`.
    `module`: another module with the CLI's `main` (the benchmark's server with its baselines mounted)."""

    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None, command: str = "serve",
                 cwd: Path = REPO, module: str = "rollout_buffer.cli") -> None:
        self.data_dir = Path(data_dir)
        self.cwd = cwd
        self.port = free_port()
        self.args = list(args)
        # In-process rollout loops and one API process unless a test asks for more (flag or env): dozens of
        # servers start in the suite, and further processes cost each one a few seconds of imports per core.
        self.env = {"ROLLOUT_BUFFER_WORKER_PROCESSES": "0", "ROLLOUT_BUFFER_API_PROCESSES": "1",
                    "ROLLOUT_BUFFER_INPUT_ROOT": input_roots_for_tests(), **os.environ, **(env or {})}
        self.command = command
        self.module = module
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = (self.cwd / self.data_dir).parent / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> "ServerProcess":  # a deadline: at load average 12 a start is slow
        (self.cwd / self.data_dir).mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", self.module, self.command, "--port", str(self.port),
               "--data-dir", str(self.data_dir), "--log-level", "warning", *self.args]
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=10.0).status_code == 200:  # slow at load
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server did not become healthy: {self.log_path.read_text()[-3000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=30)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    import orjson

    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def make_record(instance_id: str, *, uid: str | None = None, reward: float = 1.0, status: str = "completed",
                **extra: Any) -> dict[str, Any]:
    return {
        "uid": uid or uuid.uuid4().hex,
        "instance_id": instance_id,
        "messages": [{"role": "user", "content": f"q {instance_id}"}, {"role": "assistant", "content": "a"}],
        "reward": reward,
        "extra_info": {"k": instance_id},
        "status": status,
        **extra,
    }


def start_run(client: httpx.Client, input_file: Path, *, task_type: str = "math", repeats: int = 2,
              epochs: int = 1, **extra: Any) -> str:
    body = {"task_type": task_type, "input_file": str(input_file), "num_repeat_per_sample": str(repeats),
            "num_epoch": str(epochs), "num_process": "4", **extra}
    response = client.post("/start_rollout", json=body)
    assert response.status_code == 200, response.text
    return response.json()["run_id"]


class SlimeLikeDataBuffer:
    """The surface of slime's `RolloutDataSourceWithBuffer` the agent rollout uses: a FIFO of groups
    (`add_samples` / `get_samples` / `get_buffer_length`) and the resume metadata dict."""

    def __init__(self, metadata: dict[str, Any] | None = None) -> None:
        self.buffer: list[list[Any]] = []
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.add_calls = 0

    def get_metadata(self) -> dict[str, Any]:
        return self.metadata

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        self.metadata.update(metadata)

    def add_samples(self, samples: list[list[Any]]) -> None:
        assert isinstance(samples, list) and all(isinstance(group, list) and group for group in samples)
        self.add_calls += 1
        self.buffer.extend(samples)

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        taken = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        return taken

    def get_buffer_length(self) -> int:
        return len(self.buffer)
