"""mini-swe-agent (PyPI), unmodified, through litellm's OpenAI provider (`OPENAI_BASE_URL`,
`OPENAI_API_KEY`) against the gateway backed by the test engine, which answers its `bash` tool with a shell
call, then with mini-swe-agent's submit command. Every request it makes is a token-exact turn of one branch."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_buffer.testing.engine import run_engine_in_thread
from rollout_buffer.testing.tokenizer import load_qwen_tokenizer
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
from tests.support.mini_swe_agent import install_mini_swe_agent

SERVER = ServerSpec(args=("--session-timeout-s", "120"))
RUNNER = Path(__file__).with_name("mini_swe_agent_run.py")


@pytest.fixture(scope="module")
def mini_python() -> Path:
    return install_mini_swe_agent()  # raises (fails the test) when the install fails


@pytest.mark.timeout(900)
def test_mini_swe_agent_trains_token_exact(mini_python: Path, client: httpx.Client, qwen_tokenizer_path: str,
                                           tmp_path: Path) -> None:
    with run_engine_in_thread(template="qwen2.5", seed=17) as engine:
        run_id = start_external(client, engine.url, qwen_tokenizer_path, repeats=1,
                                sampling_params={"max_tokens": 256, "temperature": 1.0})
        session = new_session(client, run_id, "mini-1")
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(tmp_path),
               "OPENAI_BASE_URL": session["openai_base_url"], "OPENAI_API_KEY": session["api_key"],
               "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        done = subprocess.run([str(mini_python), str(RUNNER), "What is 17 * 23 + 4?"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-4000:]
        outcome: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        assert outcome["result"]["exit_status"] == "Submitted", outcome
        assert outcome["result"]["submission"].strip() == "395", outcome
        finish(client, session, 1.0)
        [record] = read_group(client, run_id, 1)
        calls = engine_calls_of(engine, session["session_id"])
    assert len(calls) == 2
    assert_turns_are_engine_calls(record, calls)
    assert_one_branch(record)
    tokenizer = load_qwen_tokenizer("qwen2.5")
    first, last = record["turns"]
    assert '"name": "bash"' in tokenizer.decode(first["output_ids"]), "a shell call first"
    tool_result = tokenizer.decode(last["prompt_ids"][len(first["prompt_ids"]) + len(first["output_ids"]):])
    assert "395" in tool_result, "mini-swe-agent ran the command and sent its output back"
    stats = client.get(f"/runs/{run_id}").json()["stats"]
    assert stats["gateway_turns"] == 2 and "gateway_forks" not in stats
