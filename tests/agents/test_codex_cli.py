"""Codex CLI, unmodified and with its default config (only a custom Responses provider added), headless
(`codex exec`) against the gateway backed by the test engine, which answers Codex's `exec_command` tool with
a shell call, then the final answer. Codex's default request carries a hosted `web_search` tool and the
`multi_agent_v1` namespace: both must pass. Every request Codex makes is a token-exact turn of one branch,
against a plain model and a thinking one (Qwen3), whose signed reasoning Codex replays."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.testing.engine import run_engine_in_thread
from rollout_buffer.testing.tokenizer import load_qwen_tokenizer, qwen_tokenizer_dir
from tests.support.npm_tools import cache_root
from tests.support.codex_cli import install_codex, provider_config
from tests.support.gateway import (
    assert_one_branch,
    assert_turns_are_engine_calls,
    engine_calls_of,
    finish,
    new_session,
    read_group,
    start_external,
)
from tests.support.helpers import ServerSpec

SERVER = ServerSpec(args=("--session-timeout-s", "120"))


@pytest.fixture(scope="module")
def codex_binary() -> Path:
    return install_codex()  # raises (fails the test) when npm is missing or the install fails


@pytest.fixture
def codex_home() -> Iterator[Path]:
    """A fresh HOME outside /tmp: Codex's sandbox (bubblewrap) mounts its own /tmp, which would hide the
    helper links Codex keeps under `~/.codex/tmp` and runs its sandboxed commands through."""
    root = cache_root() / "homes"
    root.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="codex-", dir=root))
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(params=["qwen2.5", "qwen3"], ids=["plain", "thinking"])
def codex_engine(request: pytest.FixtureRequest) -> Iterator[tuple[Any, str]]:
    """The engine, its tokenizer path and tokenizer: Qwen2.5, and Qwen3 whose reasoning Codex replays
    (signed, with `include: ["reasoning.encrypted_content"]`, as Codex asks by default)."""
    with run_engine_in_thread(template=request.param, seed=13) as engine:
        yield engine, request.param


@pytest.mark.timeout(600)
def test_codex_exec_with_its_default_config_trains_token_exact(codex_binary: Path, client: httpx.Client,
                                                               codex_engine: tuple[Any, str],
                                                               codex_home: Path, tmp_path: Path) -> None:
    rollout_engine, template = codex_engine
    qwen_tokenizer = load_qwen_tokenizer(template)
    run_id = start_external(client, rollout_engine.url, str(qwen_tokenizer_dir(template)), repeats=1, reasoning_parser="qwen3",
                            sampling_params={"max_tokens": 512, "temperature": 1.0})
    session = new_session(client, run_id, "codex-1")
    home, work = codex_home, tmp_path / "work"
    (home / ".codex").mkdir()
    work.mkdir()
    (home / ".codex" / "config.toml").write_text(provider_config(session["openai_base_url"], "ROLLOUT_API_KEY"))
    env = {"HOME": str(home), "PATH": f"{codex_binary.parent}:{os.environ.get('PATH', os.defpath)}",
           "ROLLOUT_API_KEY": session["api_key"]}
    done = subprocess.run([str(codex_binary), "exec", "--skip-git-repo-check", "What is 12 * 12 - 7?"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "\\boxed{137}" in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
    finish(client, session, 1.0)
    [record] = read_group(client, run_id, 1)
    calls = engine_calls_of(rollout_engine, session["session_id"])
    assert_turns_are_engine_calls(record, calls)
    assert_one_branch(record)
    first, last = record["turns"]
    assert '"name": "exec_command"' in qwen_tokenizer.decode(first["output_ids"]), "a shell call first"
    tool_result = qwen_tokenizer.decode(last["prompt_ids"][len(first["prompt_ids"]) + len(first["output_ids"]):])
    assert "137" in tool_result, "Codex ran the command and sent its output back"
    thoughts = [m.get("reasoning_content") for m in record["messages"] if m["role"] == "assistant"]
    assert all(thoughts) == (template == "qwen3"), thoughts  # Codex replayed signed reasoning: still one branch
    names = {t["function"]["name"] for t in record["tools"]}
    assert {"exec_command", "multi_agent_v1.spawn_agent"} <= names and "web_search" not in names
    stats = client.get(f"/runs/{run_id}").json()["stats"]
    assert stats["gateway_turns"] == 2 and "gateway_forks" not in stats
    assert stats["gateway_ignored_tools:web_search"] == 2
