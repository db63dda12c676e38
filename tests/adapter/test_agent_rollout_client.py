"""The adapter's buffer calls and metrics: start_rollout, get_rollout_data, log_raw_info, settings.

Against a real `rollout-buffer serve` process (task "external": the test writes the records), plus tiny
aiohttp apps for answers a real buffer never gives.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from slime_adapter.hooks.agent_rollout import (
    BufferUnavailableError,
    StartRolloutRejected,
    build_start_payload,
    get_rollout_data,
    log_raw_info,
    skip_ids_from_metadata,
    start_rollout,
)
from slime_adapter.reading.buffer_client import long_poll_wait_s
from slime_adapter.samples.build import BuildStats
from slime_adapter.settings import AgentRolloutSettings
from tests.support.helpers import ServerProcess, ServerSpec, free_port, make_record, write_jsonl

SERVER = ServerSpec(shared="external_buffer")


@pytest.fixture()
def input_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(6)])


def slime_args(url: str, input_file: Path, **extra: Any) -> SimpleNamespace:
    values: dict[str, Any] = {
        "agent_rollout_buffer_url": url, "rollout_task_type": "external", "prompt_data": str(input_file),
        "n_samples_per_prompt": 2, "rollout_batch_size": 2, "num_epoch": 1, "rollout_num_process": 4,
        "agent_start_rollout_attempts": 2, "agent_start_rollout_backoff_s": 0.05,
    }
    values.update(extra)
    return SimpleNamespace(**values)


def test_settings_defaults_and_url_precedence() -> None:
    settings = AgentRolloutSettings.from_args(SimpleNamespace())
    assert (settings.loss_mask_type, settings.task_type, settings.fetch_retry_times) == ("qwen", "math", -1)
    assert (settings.n_samples_per_prompt, settings.rollout_batch_size, settings.num_epoch) == (1, 1, 3)
    assert settings.use_wandb is False and settings.remote_engine_url == "" and settings.max_response_len is None
    both = SimpleNamespace(agent_rollout_buffer_url="http://a:1/", rollout_buffer_url="http://b:2/",
                           sglang_router_ip="10.0.0.5", sglang_router_port=3000, num_epoch=None)
    settings = AgentRolloutSettings.from_args(both)
    assert settings.buffer_url == "http://b:2", "slime's own --rollout-buffer-url wins"
    assert settings.remote_engine_url == "http://10.0.0.5:3000"
    assert settings.num_epoch == 3, "argparse's None means: not given"
    fallback = SimpleNamespace(agent_rollout_buffer_url="http://a:1", rollout_buffer_url=None)
    assert AgentRolloutSettings.from_args(fallback).buffer_url == "http://a:1", "the old name is a fallback"
    with pytest.raises(ValueError, match="rollout_batch_size"):
        AgentRolloutSettings.from_args(SimpleNamespace(rollout_batch_size=0))


def test_settings_fork_policy_and_loss_mask_verify() -> None:
    settings = AgentRolloutSettings.from_args(SimpleNamespace())
    assert settings.fork_policy == "last", "slime asserts groups of exactly n_samples_per_prompt"
    assert settings.loss_mask_verify == "cheap"
    chosen = AgentRolloutSettings.from_args(SimpleNamespace(agent_fork_policy="all", agent_loss_mask_verify="full"))
    assert (chosen.fork_policy, chosen.loss_mask_verify) == ("all", "full")
    with pytest.raises(ValueError, match="agent_fork_policy"):
        AgentRolloutSettings.from_args(SimpleNamespace(agent_fork_policy="drop"))
    with pytest.raises(ValueError, match="agent_loss_mask_verify"):
        AgentRolloutSettings.from_args(SimpleNamespace(agent_loss_mask_verify="sometimes"))


def test_start_payload_is_slimes_and_skips_the_union_of_metadata(tmp_path: Path) -> None:
    args = slime_args("http://x:1", tmp_path / "in.jsonl", hf_checkpoint="/tok", rollout_max_response_len=64,
                      rollout_temperature=0.7, rollout_top_p=0.9, sglang_router_ip="h", sglang_router_port=9)
    metadata = {"0": ["i1", "i2"], "1": ["i2", 7], "2": {"groups": ["1:i1", "0:i3"]}, "apf_state": {"x": 1}}
    assert skip_ids_from_metadata(metadata) == ["i1", "i2", "i2", "7"], "slime's form: one entry per trained group"
    payload = build_start_payload(AgentRolloutSettings.from_args(args), metadata)
    assert payload == {
        "num_process": "4", "num_epoch": "1", "remote_engine_url": "http://h:9", "remote_buffer_url": "http://x:1",
        "task_type": "external", "input_file": str(tmp_path / "in.jsonl"), "num_repeat_per_sample": "2",
        "max_tokens": "64", "sampling_params": {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9,
                                                # slime asks SGLang for top-p replay below top_p 1
                                                "custom_params": {"return_top_p_token_ids": True}},
        "tokenizer_path": "/tok", "skip_instance_ids": ["i1", "i2", "i2", "7"], "skip_groups": ["1:i1", "0:i3"],
    }
    with pytest.raises(ValueError, match="prompt_data"):
        build_start_payload(AgentRolloutSettings.from_args(SimpleNamespace()), {})


def test_start_options_reach_the_run_and_cannot_contradict_slimes_arguments(server: ServerProcess,
                                                                           input_file: Path) -> None:
    """`agent_start_options` (a dict, or JSON text as slime's YAML or a command line gives it) adds run
    fields the adapter has no slime argument for; one it already sends is refused, naming it."""
    for form in ({"max_task_attempts": 7, "rollout_timeout_s": 90}, '{"max_task_attempts": 7, "rollout_timeout_s": 90}'):
        run_id = f"opts-{'text' if isinstance(form, str) else 'dict'}"
        answer = start_rollout(server.url, slime_args(server.url, input_file, agent_rollout_run_id=run_id,
                                                      agent_start_options=form), {})
        assert answer["created"] is True
        config = httpx.get(f"{server.url}/runs/{run_id}", timeout=10).json()["config"]
        assert str(config["max_task_attempts"]) == "7" and float(config["rollout_timeout_s"]) == 90, config
    clash = slime_args(server.url, input_file, agent_start_options={"num_repeat_per_sample": 8})
    with pytest.raises(ValueError, match="'num_repeat_per_sample'.*slime's own arguments"):
        start_rollout(server.url, clash, {})
    for bad, why in (("{not json", "not JSON"), ("[1]", "JSON object"), (5, "JSON object")):
        with pytest.raises(ValueError, match=why):
            AgentRolloutSettings.from_args(SimpleNamespace(agent_start_options=bad))


async def test_long_poll_waits_then_returns_a_completed_group(server: ServerProcess, input_file: Path) -> None:
    answer = start_rollout(server.url, slime_args(server.url, input_file, agent_rollout_run_id="poll"), {})
    assert answer["run_id"] == "poll" and answer["created"] is True
    began = time.monotonic()
    data, meta = await get_rollout_data(server.url, timeout=1.5, run_id="poll")
    waited = time.monotonic() - began
    assert data == [] and meta == {}
    assert long_poll_wait_s(1.5) - 0.1 <= waited < 1.5, f"the poll should wait ~wait_s, took {waited:.2f}s"

    def write_group() -> None:
        time.sleep(0.3)
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for reward in (1.0, 0.0):
                assert client.post("/buffer/write", json=make_record("i3", run_id="poll", reward=reward)).status_code == 200

    writer = threading.Thread(target=write_group)
    writer.start()
    began = time.monotonic()
    data, meta = await get_rollout_data(server.url, num=4, timeout=20.0, run_id="poll")
    elapsed = time.monotonic() - began
    writer.join(timeout=10)
    assert [r["instance_id"] for r in data] == ["i3", "i3"] and sorted(r["reward"] for r in data) == [0.0, 1.0]
    assert meta["finished_groups"] == ["i3"] and meta["total_samples"] == 2 and meta["avg_reward"] == 0.5
    assert elapsed < 5.0, f"the long poll answered {elapsed:.1f}s after the group completed"


def answer(body: str, status: int = 200) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler that always answers `body`."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=body, status=status, content_type="application/json")

    return handler


async def test_malformed_answers_raise_value_error_naming_the_keys(tiny_server: Any) -> None:
    good_record = make_record("i0")
    bodies: dict[str, tuple[str, str]] = {
        "/notjson/get_rollout_data": ("{nope", "non-JSON"),
        "/list/get_rollout_data": ("[1, 2]", "expected an object"),
        "/nosuccess/get_rollout_data": ('{"data": {"data": [], "meta_info": {}}}', "'success'"),
        "/nometa/get_rollout_data": ('{"success": true, "data": {"data": []}}', "'meta_info'"),
        "/flat/get_rollout_data": ('{"success": true, "data": []}', "'data' is a list"),
    }
    bad_record = {k: v for k, v in good_record.items() if k not in ("reward", "extra_info")}
    app = web.Application()
    for path, (body, _) in bodies.items():
        app.router.add_post(path, answer(body))
    records = {"success": True, "message": "", "data": {"data": [good_record, bad_record], "meta_info": {}}}
    app.router.add_post("/record/get_rollout_data", answer(json.dumps(records)))
    app.router.add_post("/error/get_rollout_data", answer("boom", status=500))
    url = tiny_server(app)
    for path, (_, needle) in bodies.items():
        with pytest.raises(ValueError, match=needle):
            await get_rollout_data(url + path.removesuffix("/get_rollout_data"), timeout=5)
    with pytest.raises(ValueError, match=r"record 1 .*missing key\(s\) \['extra_info', 'reward'\]"):
        await get_rollout_data(url + "/record", timeout=5)
    with pytest.raises(aiohttp.ClientResponseError) as info:
        await get_rollout_data(url + "/error", timeout=5)
    assert info.value.status == 500 and "boom" in info.value.message


async def test_network_error_and_timeout(tiny_server: Any) -> None:
    with pytest.raises(aiohttp.ClientError):
        await get_rollout_data(f"http://127.0.0.1:{free_port()}", timeout=5)

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(10)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/get_rollout_data", hang)
    url = tiny_server(app)
    began = time.monotonic()
    with pytest.raises(asyncio.TimeoutError) as info:
        await get_rollout_data(url, timeout=0.5)
    assert not isinstance(info.value, aiohttp.ClientError)
    assert time.monotonic() - began < 3.0


def test_start_rollout_retries_5xx_then_raises(tiny_server: Any, input_file: Path) -> None:
    hits: list[float] = []

    async def unavailable(request: web.Request) -> web.Response:
        hits.append(time.monotonic())
        return web.json_response({"message": "warming up"}, status=503)

    app = web.Application()
    app.router.add_post("/start_rollout", unavailable)
    url = tiny_server(app)
    args = slime_args(url, input_file, agent_start_rollout_attempts=3, agent_start_rollout_backoff_s=0.1)
    with pytest.raises(BufferUnavailableError, match=r"after 3 attempt\(s\).*warming up"):
        start_rollout(url, args, {})
    assert len(hits) == 3
    gaps = [b - a for a, b in itertools.pairwise(hits)]
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19, f"backoff must grow exponentially: {gaps}"


def test_start_rollout_on_a_dead_server_raises_clearly(input_file: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    began = time.monotonic()
    with pytest.raises(BufferUnavailableError, match="could not start a rollout run"):
        start_rollout(url, slime_args(url, input_file, agent_start_rollout_attempts=3), {})
    assert 0.1 <= time.monotonic() - began < 10


def test_start_rollout_4xx_is_not_retried(tiny_server: Any, server: ServerProcess, input_file: Path) -> None:
    hits: list[int] = []

    async def refuse(request: web.Request) -> web.Response:
        hits.append(1)
        return web.json_response({"message": "input_file: not readable"}, status=422)

    app = web.Application()
    app.router.add_post("/start_rollout", refuse)
    url = tiny_server(app)
    with pytest.raises(StartRolloutRejected, match="not readable") as info:
        start_rollout(url, slime_args(url, input_file, agent_start_rollout_attempts=5), {})
    assert hits == [1] and info.value.status_code == 422
    with pytest.raises(StartRolloutRejected, match="task_type") as info:
        start_rollout(server.url, slime_args(server.url, input_file, rollout_task_type="no-such-task"), {})
    assert 400 <= info.value.status_code < 500


META = [
    {"total_samples": 4, "num_groups": 2, "avg_group_size": 2.0, "avg_reward": 0.5,
     "status_counts": {"completed": 3, "failed": 1}, "finished_groups": ["a", "b"], "filtered_groups": ["b"],
     "timed_out_groups": [], "returned_samples": 2, "drops": {"filtered_group": 1}},
    {"total_samples": 2, "num_groups": 1, "avg_group_size": 2.0, "avg_reward": 1.0,
     "status_counts": {"completed": 2}, "finished_groups": ["c"], "filtered_groups": [],
     "timed_out_groups": ["c"], "returned_samples": 2, "drops": {"filtered_group": 1, "skipped_group": 2}},
]


def _stats() -> BuildStats:
    stats = BuildStats(records=3, forks=1, token_path_records=2, retokenized_records=1)
    for response, generated in ((10, 8), (30, 20), (20, 5)):
        stats.add_piece(5, response, generated)
    return stats


def test_log_raw_info_without_wandb(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="slime_adapter.hooks.metrics")
    logged = log_raw_info(SimpleNamespace(use_wandb=False), META, 7, _stats())
    assert logged["rollout/no_filter/total_samples"] == 6 and logged["rollout/no_filter/num_groups"] == 3
    assert logged["rollout/no_filter/avg_reward"] == pytest.approx(4 / 6)
    assert logged["rollout/no_filter/avg_group_size"] == 2.0
    assert logged["rollout/filtered_groups"] == 1 and logged["rollout/failed_samples"] == 1
    assert logged["rollout/timed_out_groups"] == 1 and logged["rollout/finished_groups"] == 3
    assert logged["rollout/drops/skipped_group"] == 2, "drops are run totals: the last read's value"
    assert (logged["rollout/response_len/mean"], logged["rollout/response_len/max"],
            logged["rollout/response_len/min"]) == (20, 30, 10)
    assert logged["rollout/generated_tokens/mean"] == 11
    assert logged["rollout/forks"] == 1 and logged["rollout/retokenized_records"] == 1
    assert logged["rollout/step"] == 7
    assert "rollout 7:" in caplog.text and "rollout/no_filter/total_samples" in caplog.text
    empty = log_raw_info(SimpleNamespace(), [], 0)
    assert empty["rollout/no_filter/total_samples"] == 0 and empty["rollout/no_filter/avg_reward"] == 0.0


def test_log_raw_info_to_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_MODE", "WANDB_API_KEY"):  # set first so teardown restores whatever was there
        monkeypatch.setenv(name, "unset-by-test")
        monkeypatch.delenv(name)
    assert wandb.run is None
    args = SimpleNamespace(use_wandb=True, wandb_project="adapter-test", wandb_always_use_train_step=True,
                           rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=4)
    try:
        first = log_raw_info(args, META, 3, _stats())
        run = wandb.run
        assert run is not None and run.settings.mode == "offline"
        second = log_raw_info(args, META[:1], 4)
        assert wandb.run is run, "an existing run is reused"
        assert first["rollout/step"] == 6 and second["rollout/step"] == 8, "train-step x-axis: id * 8 // 4"
        assert first["rollout/no_filter/total_samples"] == 6 and "rollout/response_len/mean" in first
        run_dir = Path(run.dir).parent
    finally:
        wandb.finish()
    assert run_dir.is_relative_to(tmp_path) and run_dir.name.startswith("offline-run-")
    assert any(run_dir.glob("*.wandb")), "the offline run wrote its log file"
    assert os.environ["WANDB_MODE"] == "offline", "no API key: the adapter chose offline mode itself"
