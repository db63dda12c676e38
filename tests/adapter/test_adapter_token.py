"""The slime adapter against a buffer that requires a token: where the token comes from (namespace
attribute, then `ROLLOUT_BUFFER_AUTH_TOKEN`, then `ROLLOUT_BUFFER_AUTH_TOKEN_FILE`), a whole training step
with it (start, leased reads, acks, run checks), and a loud `BufferAuthError` instead of endless retries
without it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import pytest

from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from slime_adapter.auth import BufferAuthError, auth_headers, remember_token, token_from
from slime_adapter.hooks.agent_rollout import generate_rollout, reset_state
from slime_adapter.reading.buffer_client import fetch_rollout_data
from slime_adapter.reading.run_health import get_run_detail
from slime_adapter.settings import AgentRolloutSettings
from tests.support.helpers import REPO, ServerProcess, ServerSpec, make_record, write_jsonl

TOKEN = "adapter-token-0123456789abcdef"


SERVER = ServerSpec(args=("--task-dir", str(REPO / "tests" / "fixtures" / "tasks")),
                    env={"ROLLOUT_BUFFER_AUTH_TOKEN": TOKEN})


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch, server: ServerProcess) -> Iterator[None]:
    for name in ("ROLLOUT_BUFFER_AUTH_TOKEN", "ROLLOUT_BUFFER_AUTH_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    reset_state()
    remember_token(server.url, None)
    yield
    reset_state()
    remember_token(server.url, None)


def slime_args(url: str, input_file: Path, **extra: Any) -> SimpleNamespace:
    values: dict[str, Any] = {"rollout_buffer_url": url, "rollout_task_type": "external", "prompt_data": str(input_file),
                              "n_samples_per_prompt": 2, "rollout_batch_size": 2, "num_epoch": 1,
                              "rollout_num_process": 4, "agent_fetch_timeout_s": 5.0, "agent_fetch_backoff_s": 0.05,
                              "fetch_trajectory_retry_times": 40, "agent_start_rollout_attempts": 2,
                              "hf_checkpoint": str(qwen_tokenizer_dir("qwen2.5")), "loss_mask_type": "qwen"}
    values.update(extra)
    return SimpleNamespace(**values)


def test_token_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    monkeypatch.setenv("ROLLOUT_BUFFER_AUTH_TOKEN_FILE", str(token_file))
    assert token_from(SimpleNamespace()) == "from-file"
    monkeypatch.setenv("ROLLOUT_BUFFER_AUTH_TOKEN", "from-env")
    assert token_from(SimpleNamespace()) == "from-env"
    assert token_from(SimpleNamespace(agent_rollout_buffer_token="from-args")) == "from-args"
    settings = AgentRolloutSettings.from_args(SimpleNamespace(rollout_buffer_url="http://b:1/",
                                                              agent_rollout_buffer_token="from-args"))
    assert settings.buffer_token == "from-args" and "from-args" not in repr(settings)
    assert auth_headers("http://b:1/get_rollout_data") == {"Authorization": "Bearer from-args"}
    assert auth_headers("http://b:10/x") == {"Authorization": "Bearer from-env"}, "another buffer: the environment's"
    remember_token("http://b:1", None)
    monkeypatch.delenv("ROLLOUT_BUFFER_AUTH_TOKEN")
    token_file.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        token_from(SimpleNamespace())


def test_a_training_step_with_the_token_from_the_environment(server: ServerProcess, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             slime_data_buffer: Any) -> None:
    input_file = write_jsonl(tmp_path / "in.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(4)])
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.url, timeout=10, headers=headers) as client:
        body = {"task_type": "graded", "input_file": str(input_file), "num_repeat_per_sample": 2, "run_id": "tok-1"}
        assert client.post("/start_rollout", json=body).status_code == 200
        for i in range(2):
            for reward in (1.0, 3.0):
                answer = client.post("/buffer/write", json={**make_record(f"i{i}", reward=reward), "run_id": "tok-1"})
                assert answer.status_code == 200, answer.text
    # one step in all (slime's num_rollout): its batch is acknowledged before the step returns
    args = slime_args(server.url, input_file, rollout_task_type="graded", agent_rollout_run_id="tok-1", num_rollout=1)

    with pytest.raises(BufferAuthError, match="401"):  # no token anywhere: loud, at once
        generate_rollout(args, 0, slime_data_buffer())

    monkeypatch.setenv("ROLLOUT_BUFFER_AUTH_TOKEN", TOKEN)  # slime users: the same variable as the server's
    reset_state()
    buffer = slime_data_buffer()
    groups = generate_rollout(args, 0, buffer)
    assert sorted(g[0].metadata["instance_id"] for g in groups) == ["i0", "i1"]
    assert buffer.metadata == {"0": {"groups": ["0:i0", "0:i1"]}}
    detail = asyncio.run(get_run_detail(server.url, "tok-1"))
    assert detail is not None and detail["leases"]["batches_acked"] >= 1, "acks went through with the token"


def test_reads_without_the_token_raise_instead_of_retrying(server: ServerProcess) -> None:
    with pytest.raises(BufferAuthError):
        asyncio.run(fetch_rollout_data(server.url, None, 5.0, run_id="nothing"))
    assert asyncio.run(get_run_detail(server.url, "nothing")) is None, "a refused check says nothing"
    remember_token(server.url, TOKEN)
    with pytest.raises(aiohttp.ClientResponseError) as caught:  # past the token: the buffer's own answer
        asyncio.run(fetch_rollout_data(server.url, None, 5.0, run_id="nothing"))
    assert caught.value.status == 404
    assert asyncio.run(get_run_detail(server.url, "nothing")) == {"missing": True}
