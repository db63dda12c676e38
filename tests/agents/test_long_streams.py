"""Codex CLI and Claude Code, each configured with a stream idle timeout, through a generation several times
longer than that timeout at a slow token rate: both complete, token-exact, with no retried request.

What makes it hard is the tool call: its markup is held back until it closes (a half-written call is not
sent), so the stream has no text to send for as long as the call is being generated. The gateway sends
keep-alive events in each API's own shape meanwhile: Codex's idle timer counts events, not SSE comments.

Scaled for the suite: a 10 s idle timeout (Claude Code's smallest) and 0.5 s a token, so a tool call of
~30 tokens is ~15 s of markup. `ROLLOUT_BUFFER_FULL_LONG_STREAMS=1` runs the issue's own numbers: a 30 s
idle timeout and 4 s a token, a tool call of about 2 minutes (the two CLIs in parallel: about 4 minutes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.testing.engine import run_engine_in_thread
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from tests.support.claude_code import install_claude_code
from tests.support.codex_cli import install_codex, provider_config
from tests.support.gateway import assert_turns_are_engine_calls, engine_calls_of, finish, new_session, \
    read_group, start_external
from tests.support.helpers import ServerSpec
from tests.support.npm_tools import cache_root

FULL = os.environ.get("ROLLOUT_BUFFER_FULL_LONG_STREAMS") == "1"
IDLE_S, TOKEN_DELAY_S = (30, 4.0) if FULL else (10, 0.5)
SERVER = ServerSpec(args=("--session-timeout-s", "900"))


@pytest.fixture
def home() -> Iterator[Path]:
    """A fresh HOME outside /tmp (Codex's sandbox mounts its own /tmp)."""
    root = cache_root() / "homes"
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="long-", dir=root))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _codex(binary: Path, session: dict[str, Any], home: Path, work: Path) -> subprocess.CompletedProcess[str]:
    (home / ".codex").mkdir(parents=True)
    config = provider_config(session["openai_base_url"], "ROLLOUT_API_KEY")
    # no retries: a stream that idles out fails the run instead of being asked again
    config += f"stream_idle_timeout_ms = {IDLE_S * 1000}\nstream_max_retries = 0\nrequest_max_retries = 0\n"
    (home / ".codex" / "config.toml").write_text(config)
    env = {"HOME": str(home), "PATH": f"{binary.parent}:{os.defpath}", "ROLLOUT_API_KEY": session["api_key"]}
    return subprocess.run([str(binary), "exec", "--skip-git-repo-check", "What is 12 * 12 - 7?"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=IDLE_S * 40,
                          stdin=subprocess.DEVNULL)


def _claude(binary: Path, session: dict[str, Any], home: Path, work: Path) -> subprocess.CompletedProcess[str]:
    (home / ".claude").mkdir(parents=True)
    (home / ".claude" / "settings.json").write_text('{"permissions": {"allow": ["Bash"]}}')
    env = {"HOME": str(home), "PATH": f"{binary.parent}:{os.defpath}",
           "ANTHROPIC_BASE_URL": session["anthropic_base_url"], "ANTHROPIC_API_KEY": session["api_key"],
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": str(IDLE_S * 1000),
           "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(IDLE_S * 1000), "API_TIMEOUT_MS": str(IDLE_S * 1000),
           "CLAUDE_CODE_MAX_RETRIES": "0"}
    return subprocess.run([str(binary), "-p", "What is 12 * 12 - 7?", "--output-format", "json"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=IDLE_S * 40, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(IDLE_S * 60)
def test_codex_and_claude_code_outlast_their_stream_idle_timeout(client: httpx.Client, home: Path,
                                                                 tmp_path: Path) -> None:
    binaries = {"codex": install_codex(), "claude": install_claude_code()}
    with run_engine_in_thread(template="qwen2.5", seed=13, token_delay_s=TOKEN_DELAY_S) as engine:
        run_id = start_external(client, engine.url, str(qwen_tokenizer_dir("qwen2.5")), repeats=1,
                                sampling_params={"max_tokens": 512, "temperature": 1.0})
        sessions = {name: new_session(client, run_id, name) for name in binaries}
        done: dict[str, subprocess.CompletedProcess[str]] = {}
        took: dict[str, float] = {}

        def run(name: str) -> None:
            work = tmp_path / name
            work.mkdir()
            started = time.monotonic()
            cli = _codex if name == "codex" else _claude
            done[name] = cli(binaries[name], sessions[name], home / name, work)
            took[name] = time.monotonic() - started

        threads = [threading.Thread(target=run, args=(name,)) for name in binaries]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for name, result in done.items():
            assert result.returncode == 0, (name, result.stdout[-2000:], result.stderr[-3000:])
            assert "137" in result.stdout, (name, result.stdout[-2000:])
            finish(client, sessions[name], 1.0)
        records = {r["instance_id"]: r for r in read_group(client, run_id, 2)}
        for name, session in sessions.items():
            calls = engine_calls_of(engine, session["session_id"])
            assert_turns_are_engine_calls(records[name], calls)
            assert len(calls) == 2, f"{name}: one tool call, then the answer, nothing asked twice"
            # the tool call's markup alone was generated for longer than the idle timeout
            call_tokens = len(records[name]["turns"][0]["output_ids"])
            assert call_tokens * TOKEN_DELAY_S > 1.2 * IDLE_S, (name, call_tokens)
            assert took[name] > 1.2 * IDLE_S
        stats = client.get(f"/runs/{run_id}").json()["stats"]
        assert "gateway_streams_aborted" not in stats and "gateway_forks" not in stats, stats
