"""A clean start prints no warning: `serve`, `worker`, `test-engine` and `demo`, run as a user runs them.

Each command runs as its own process on loopback with a temp data dir, with the interpreter's default
warning filters plus deprecation warnings made visible (`PYTHONWARNINGS`), so a deprecation raised by the
project's own code shows up too. A line fails the test when it mentions a warning, a traceback or torch
(transformers' "PyTorch was not found" notice); the only lines let through are deprecation warnings raised
inside third-party packages, which users never see and the project cannot fix.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import fastapi.exceptions
import httpx
import pytest

from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from tests.support.helpers import REPO, free_port, write_jsonl

NOISE = re.compile(r"warn|traceback|torch", re.IGNORECASE)
WARNING_HEADER = re.compile(r"^(?P<file>\S.*?):\d+: (?P<category>\w+): ")
HIDDEN_BY_DEFAULT = ("DeprecationWarning", "PendingDeprecationWarning")
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_BUFFER_")},
       "PYTHONWARNINGS": "default::DeprecationWarning,default::PendingDeprecationWarning"}


def noisy_lines(output: str) -> list[str]:
    """The lines a clean start must not print (see the module docstring)."""
    noisy: list[str] = []
    skip_source_line = False
    for line in output.splitlines():
        if skip_source_line and line.startswith(" "):  # the code line `warnings` prints under a header
            skip_source_line = False
            continue
        skip_source_line = False
        header = WARNING_HEADER.match(line)
        if header and header["category"] in HIDDEN_BY_DEFAULT and not _in_project(header["file"]):
            skip_source_line = True
            continue
        if NOISE.search(line):
            noisy.append(line)
    return noisy


def _in_project(file: str) -> bool:
    path = Path(file).resolve()
    return path.is_relative_to(REPO) and ".venv" not in path.relative_to(REPO).parts


class Command:
    """`python -m rollout_buffer.cli ...` with stdout and stderr together in one log file."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "rollout_buffer.cli", *args], cwd=REPO, env=ENV,
                                         stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with {self.proc.returncode} before {text!r}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in {timeout_s:g}s:\n{self.output()}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)
            raise AssertionError(f"did not stop on SIGTERM in {timeout_s:g}s:\n{self.output()}") from None


@contextmanager
def running(log: Path, *args: str) -> Iterator[Command]:
    command = Command(log, *args)
    try:
        yield command
    finally:
        command.stop()


def test_noise_filter_flags_what_users_see_and_lets_third_party_deprecations_through() -> None:
    lib = "/usr/lib/python3/dist-packages/somelib/core.py"
    assert noisy_lines(f"{lib}:10: DeprecationWarning: old\n  old_call()\nINFO ready") == []
    assert noisy_lines(f"{lib}:10: UserWarning: careful\n  call()") == [f"{lib}:10: UserWarning: careful"]
    ours = f"{REPO}/rollout_buffer/api/app.py:3: DeprecationWarning: ours"
    assert noisy_lines(ours) == [ours]
    assert noisy_lines("2026 WARNING rollout_buffer.x: lost Redis") == ["2026 WARNING rollout_buffer.x: lost Redis"]
    torch = "[transformers] PyTorch was not found. Models won't be available"
    assert noisy_lines(torch) == [torch]


def test_deprecations_from_project_code_fail_tests_and_third_party_ones_do_not() -> None:
    """pyproject.toml's filterwarnings: this module is project code, so its deprecation is an error."""
    with pytest.raises(DeprecationWarning):
        warnings.warn("deprecated in the project", DeprecationWarning, stacklevel=1)
    with pytest.raises(FutureWarning):
        warnings.warn("changing in the project", FutureWarning, stacklevel=1)
    # FastAPI's own deprecation class is a UserWarning: tests/conftest.py makes it an error too
    fastapi_deprecation = getattr(fastapi.exceptions, "FastAPIDeprecationWarning", None)
    if fastapi_deprecation is not None:
        with pytest.raises(fastapi_deprecation):
            warnings.warn("ORJSONResponse is deprecated", fastapi_deprecation, stacklevel=1)
    if sys.warnoptions:  # `python -W error::DeprecationWarning -m pytest` makes every module's an error
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit("deprecated elsewhere", DeprecationWarning, "somelib.py", 1, module="somelib")
    assert [str(w.message) for w in caught] == ["deprecated elsewhere"]


@pytest.mark.timeout(300)
def test_serve_worker_and_test_engine_start_and_run_without_warnings(tmp_path: Path) -> None:
    data_dir, engine_port, port = tmp_path / "data", free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    prompts = write_jsonl(tmp_path / "math.jsonl", [
        {"instance_id": f"q{i}", "prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(4)])
    with ExitStack() as stack:
        engine = stack.enter_context(running(tmp_path / "engine.log", "test-engine", "--port", str(engine_port)))
        server = stack.enter_context(running(tmp_path / "serve.log", "serve", "--port", str(port),
                                             "--data-dir", str(data_dir), "--input-root", str(tmp_path),
                                             "--input-root", str(qwen_tokenizer_dir("qwen2.5"))))
        engine.wait_for("listening on")
        server.wait_for("Application startup complete")
        worker = stack.enter_context(running(tmp_path / "worker.log", "worker", "--data-dir", str(data_dir)))
        worker.wait_for(" ready on ")
        with httpx.Client(base_url=url, timeout=30) as client:
            for path in ("/health", "/docs", "/static/docs/swagger-ui.css", "/openapi.json", "/tasks", "/metrics"):
                assert client.get(path).status_code == 200, path
            answer = client.post("/start_rollout", json={
                "task_type": "math", "input_file": str(prompts), "num_repeat_per_sample": "2", "num_epoch": "1",
                "num_process": "8", "remote_engine_url": f"http://127.0.0.1:{engine_port}",
                "tokenizer_path": str(qwen_tokenizer_dir("qwen2.5")), "sampling_params": {"max_tokens": 64}})
            assert answer.status_code == 200, answer.text
            records: list[dict[str, object]] = []
            deadline = time.monotonic() + 120
            while len(records) < 8 and time.monotonic() < deadline:
                records += client.post("/get_rollout_data", json={"wait_s": 1.0}).json()["data"]["data"]
            assert len(records) == 8 and all(r["status"] != "failed" for r in records)
        # workers first: a worker whose Redis went away would (rightly) warn. uvicorn re-raises the SIGTERM it
        # handled once it has shut down cleanly, so the server's exit status is -SIGTERM.
        assert worker.stop() == 0 and server.stop() in (0, -signal.SIGTERM) and engine.stop() == 0
    for command in (engine, server, worker):
        assert noisy_lines(command.output()) == [], command.output()
    assert "Application startup complete" in server.output() and "GET /docs" in server.output()


@pytest.mark.timeout(300)
def test_demo_runs_to_the_end_without_warnings(tmp_path: Path) -> None:
    demo = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "demo", "--keep"], cwd=REPO,
                          env={**ENV, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=240)
    output = demo.stdout + demo.stderr
    assert demo.returncode == 0, output
    assert "8 groups, 32 trajectories" in output and "'done': 32" in output
    assert noisy_lines(output) == [], output
    (server_log,) = tmp_path.glob("rb-demo-*/server.log")  # the buffer the demo ran, at --log-level warning
    assert noisy_lines(server_log.read_text()) == [], server_log.read_text()
