"""Claude Code, unmodified and headless, as an `agent_command` run: installed from the npm registry (cached),
run in local, bwrap and docker sandboxes (no network: its model socket only; the CLI mounted read-only, Node.js
from the host's /usr in bwrap and from the test image in docker)
against the gateway backed by the test engine (which answers Claude Code's Bash tool
with a tool call, then the final answer). 8 problems x 2 repeats: every request Claude Code makes is a
token-exact turn of its rollout's record, its answer reaches the verifier, and the groups reach the adapter."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from slime_adapter.samples.build import build_group_samples
from tests.support.agents import sandbox_root, start_agent_run
from rollout_buffer.agents.bwrap import DEFAULT_ROOT
from tests.support.claude_code import install_claude_code, readable_by_any_uid
from tests.support.docker_env import docker_env, docker_sandboxes_of  # noqa: F401 - docker_env: the session fixture
from tests.support.gateway import assert_one_branch, assert_turns_are_engine_calls, engine_calls_of
from tests.support.helpers import ServerProcess, ServerSpec
from tests.support.runtime_helpers import assert_whole_groups, drain, wait_status

PROBLEMS = [("12 * 12 - 7", 137), ("81 / 9 + 1", 10), ("25 * 4 + 3", 103), ("7 * 8 - 6", 50),
            ("100 - 37 * 2", 26), ("15 * 15", 225), ("(3 + 4) * 9", 63), ("144 / 12 * 5", 60)]


SERVER = ServerSpec(args=("--agent-sandbox", "local", "--agent-sandbox", "bwrap", "--agent-sandbox", "docker"))


@pytest.fixture(scope="module")
def claude_binary() -> Path:
    return install_claude_code()  # raises (fails the test) when npm is missing or the install fails


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["local", "bwrap", "docker"])
def test_claude_code_headless_runs_as_an_agent_command(claude_binary: Path, server: ServerProcess,
                                                       client: httpx.Client, rollout_engine: Any,
                                                       qwen_tokenizer: Any, qwen_tokenizer_path: str,
                                                       tmp_path: Path, backend: str,
                                                       request: pytest.FixtureRequest) -> None:
    rows = [{"instance_id": f"cc{i}", "prompt": f"What is {expr}?", "label": str(value)}
            for i, (expr, value) in enumerate(PROBLEMS)]
    install = claude_binary.parents[2]  # <install>/node_modules/.bin/claude
    if backend == "bwrap":  # the sandbox's uid reads the CLI from a read-only mount
        install = readable_by_any_uid(install)
        sandbox = {"backend": "bwrap", "options": {"ro_binds": [str(install)]}}
    elif backend == "docker":  # the test image has Node.js; the CLI is mounted read-only
        install = readable_by_any_uid(install)
        env = request.getfixturevalue("docker_env")
        sandbox = {"backend": "docker", "options": {"ro_binds": [str(install)], "image": env.image,
                                                    "docker_host": env.url}}
    else:
        sandbox = {"backend": "local", **sandbox_root(tmp_path)}
    agent = {"command": "claude -p {prompt} --output-format json", "api": "anthropic",
             "env": {"PATH": f"{install / 'node_modules' / '.bin'}:{os.defpath}",
                     "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"},
             "files": {"~/.claude/settings.json": {"permissions": {"allow": ["Bash"]}}},
             "timeout_s": 240, "max_concurrent_agents": 4, "verifier": {"type": "exact_answer"},
             "sandbox": sandbox}
    answer = start_agent_run(client, server.url, tmp_path, rows, agent, engine_url=rollout_engine.url,
                             tokenizer_path=qwen_tokenizer_path, repeats=2,
                             sampling_params={"max_tokens": 512, "temperature": 1.0})
    assert answer.status_code == 200, answer.text
    run_id = answer.json()["run_id"]
    records = drain(client, run_id, 16, timeout_s=600)
    detail = wait_status(client, run_id, "finished")
    assert_whole_groups(records, instance_ids=[r["instance_id"] for r in rows], epochs=1, repeats=2)
    labels = {r["instance_id"]: r["label"] for r in rows}
    for record in records:
        info = record["extra_info"]
        assert record["status"] == "completed", info
        assert info["agent"]["exit_code"] == 0 and '"type":"result"' in info["agent"]["stdout_tail"]
        # every model call Claude Code made is one turn: the engine's ids and logprobs, one branch
        assert_turns_are_engine_calls(record, engine_calls_of(rollout_engine, info["session_id"]))
        assert_one_branch(record)
        first, last = record["turns"]
        assert '"name": "Bash"' in qwen_tokenizer.decode(first["output_ids"]), "a Bash tool call first"
        tool_result = qwen_tokenizer.decode(last["prompt_ids"][len(first["prompt_ids"]) + len(first["output_ids"]):])
        assert f"<tool_response>\n{labels[record['instance_id']]}" in tool_result, "Claude Code ran Bash in the sandbox"
        assert len(first["output_ids"]) <= 512 and last["prompt_ids"][:len(first["prompt_ids"])] == first["prompt_ids"]
        # its final answer reached the verifier
        assert info["verifier"]["answer"] == labels[record["instance_id"]] and record["reward"] == 1.0
        assert f"\\boxed{{{labels[record['instance_id']]}}}" in info["agent"]["final_text"]
    samples, stats = build_group_samples(records, lambda: pytest.fail("the token path needs no tokenizer"))
    assert stats.token_path_records == 16 and stats.forks == 0 and len(samples) == 16
    counters = detail["stats"]
    assert counters["gateway_turns"] == 32 and counters["records_written"] == 16
    for field in ("thinking", "context_management", "output_config", "metadata"):  # accepted, ignored, counted
        assert counters[f"gateway_ignored_fields:{field}"] == 32, field
    assert detail["failures"]["total"] == 0
    if backend == "bwrap":
        assert not [p for p in DEFAULT_ROOT.iterdir() if p.name.startswith(run_id)], "every sandbox was removed"
    elif backend == "docker":
        assert not docker_sandboxes_of(request.getfixturevalue("docker_env"), run_id), "every container was removed"
    else:
        assert list((tmp_path / "sandboxes").iterdir()) == [], "every sandbox was removed"
