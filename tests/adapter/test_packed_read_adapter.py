"""The adapter's side of the packed read: it asks for the packed form by default, decodes it into arrays,
and builds exactly the Samples the JSON form gives; `agent_read_format` / `ROLLOUT_BUFFER_READ_FORMAT`
force JSON; a buffer without the packed form is read as JSON; the token path on arrays follows the same
rule as a plain-list statement of it."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from rollout_buffer.wire import packed_read
from rollout_buffer.wire.schema import Turn
from slime_adapter.hooks.agent_rollout import generate_rollout, reset_state
from slime_adapter.reading.buffer_client import fetch_rollout_data, read_format_default
from slime_adapter.samples.build import build_samples
from slime_adapter.samples.token_path import build_token_pieces
from slime_adapter.settings import AgentRolloutSettings
from tests.support.helpers import ServerProcess, make_record, write_jsonl
from tests.support.trajectories import forked_trajectory, plain, tool_trajectory


@pytest.fixture(autouse=True)
def read_format_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter's default read format, whatever the environment says (the state reset: conftest)."""
    monkeypatch.delenv("ROLLOUT_BUFFER_READ_FORMAT", raising=False)


@pytest.fixture()
def input_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(4)])


@pytest.fixture()
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the packed answers the adapter decoded."""
    calls: list[int] = []
    real = packed_read.decode

    def counting(body: bytes) -> dict[str, Any]:
        calls.append(len(body))
        return real(body)

    monkeypatch.setattr(packed_read, "decode", counting)
    return calls


def slime_args(url: str, input_file: Path, run_id: str, **extra: Any) -> SimpleNamespace:
    values: dict[str, Any] = {
        "rollout_buffer_url": url, "rollout_task_type": "graded", "prompt_data": str(input_file),
        "n_samples_per_prompt": 2, "rollout_batch_size": 2, "num_epoch": 1, "rollout_num_process": 4,
        "hf_checkpoint": str(qwen_tokenizer_dir("qwen2.5")), "loss_mask_type": "qwen", "agent_rollout_run_id": run_id,
        "agent_fetch_timeout_s": 5.0, "agent_fetch_backoff_s": 0.05, "fetch_trajectory_retry_times": 20,
    }
    values.update(extra)
    return SimpleNamespace(**values)


def records(tok: Any) -> list[dict[str, Any]]:
    """Three groups of two: filtered (all zero), token path (float64 logprobs), a fork and a message-path
    record (re-rendered by the chat template)."""
    zero = [{**make_record("i0", reward=0.0), "uid": f"z{k}"} for k in range(2)]
    tools = [tool_trajectory(tok, "i1", 1, exact32=False), tool_trajectory(tok, "i1", 2, exact32=True)]
    tools[0]["reward"], tools[1]["reward"] = 1.0, 3.0
    mixed = [forked_trajectory(tok, "i2", 3),
             {**make_record("i2", reward=2.0, messages=[{"role": "user", "content": "What is 6*7?"},
                                                        {"role": "assistant", "content": "\n42"}]),
              "uid": "m0", "timestamp": 2000.0}]
    return zero + tools + mixed


def start_and_fill(url: str, input_file: Path, run_id: str, data: list[dict[str, Any]]) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        body = {"task_type": "graded", "input_file": str(input_file), "num_repeat_per_sample": 2, "run_id": run_id}
        assert client.post("/start_rollout", json=body).status_code == 200
        for record in data:
            answer = client.post("/buffer/write", json={**record, "run_id": run_id})
            assert answer.status_code == 200 and answer.json()["success"], answer.text


def test_generate_rollout_builds_the_same_samples_from_both_forms(
        external_buffer: ServerProcess, input_file: Path, qwen_tokenizer: Any, slime_data_buffer: Any,
        decodes: list[int]) -> None:
    data = records(qwen_tokenizer)
    built: dict[str, tuple[list[list[Any]], dict[str, Any]]] = {}
    for read_format in ("json", "packed"):
        run_id = f"fmt-{read_format}-{uuid.uuid4().hex[:8]}"
        start_and_fill(external_buffer.url, input_file, run_id, data)
        reset_state()
        buffer = slime_data_buffer()
        before = len(decodes)
        groups = generate_rollout(slime_args(external_buffer.url, input_file, run_id, agent_read_format=read_format),
                                  0, buffer)
        assert (len(decodes) > before) is (read_format == "packed"), "packed answers were asked for and decoded"
        built[read_format] = groups, buffer.metadata
    (json_groups, json_meta), (packed_groups, packed_meta) = built["json"], built["packed"]
    assert json_meta == packed_meta == {"0": {"groups": ["0:i0", "0:i1", "0:i2"]}}
    assert [[s.to_dict() for s in g] for g in packed_groups] == [[s.to_dict() for s in g] for g in json_groups]
    assert [[s.metadata["uid"] for s in g] for g in packed_groups] == [["i1-1", "i1-2"], ["i2-3", "m0"]]
    token_sample = packed_groups[0][0]
    assert type(token_sample.tokens) is list and type(token_sample.tokens[0]) is int
    assert type(token_sample.rollout_log_probs[0]) is float and type(token_sample.loss_mask[0]) is int
    turns = data[2]["turns"]
    generated = [x for t in turns for x in t["output_logprobs"]]
    assert [lp for lp, m in zip(token_sample.rollout_log_probs, token_sample.loss_mask) if m] == generated
    assert sorted(s.reward for s in packed_groups[0]) == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert packed_groups[1][1].metadata["mask_source"] == "retokenized"


async def test_fetch_gives_arrays_when_packed_and_lists_when_json(external_buffer: ServerProcess, input_file: Path,
                                                                  qwen_tokenizer: Any) -> None:
    run_id = f"fetch-{uuid.uuid4().hex[:8]}"
    data = records(qwen_tokenizer)
    await asyncio.to_thread(start_and_fill, external_buffer.url, input_file, run_id, data)
    packed, meta, _ = await fetch_rollout_data(external_buffer.url, None, 10.0, run_id=run_id, lease_s=60,
                                               batch_id="f", wait_s=0.0)
    as_json, json_meta, _ = await fetch_rollout_data(external_buffer.url, None, 10.0, run_id=run_id, lease_s=60,
                                                     batch_id="f", wait_s=0.0, read_format="json")
    assert isinstance(packed[0]["turns"][0]["output_ids"], np.ndarray), "packed is the default"
    assert isinstance(as_json[0]["turns"][0]["output_ids"], list)
    assert plain(packed) == as_json and meta["retry"] is False and json_meta["retry"] is True
    with pytest.raises(ValueError, match="read_format must be one of"):
        await fetch_rollout_data(external_buffer.url, None, 10.0, run_id=run_id, read_format="xml")


def test_read_format_flag_and_environment(monkeypatch: pytest.MonkeyPatch, input_file: Path) -> None:
    args = slime_args("http://127.0.0.1:9", input_file, "x")
    assert AgentRolloutSettings.from_args(args).read_format == "packed" and read_format_default() == "packed"
    monkeypatch.setenv("ROLLOUT_BUFFER_READ_FORMAT", "JSON")
    assert AgentRolloutSettings.from_args(args).read_format == "json" and read_format_default() == "json"
    args.agent_read_format = "packed"
    assert AgentRolloutSettings.from_args(args).read_format == "packed", "the argument wins over the environment"
    args.agent_read_format = "msgpack"
    with pytest.raises(ValueError, match="agent_read_format .* must be one of"):
        AgentRolloutSettings.from_args(args)
    monkeypatch.setenv("ROLLOUT_BUFFER_READ_FORMAT", "bson")
    with pytest.raises(ValueError, match="ROLLOUT_BUFFER_READ_FORMAT must be one of"):
        read_format_default()


async def test_a_buffer_without_the_packed_form_is_read_as_json(tiny_server: Any) -> None:
    accepts: list[str] = []
    record = make_record("i0")

    async def json_only(request: web.Request) -> web.Response:
        accepts.append(request.headers.get("Accept", ""))
        return web.json_response({"success": True, "message": "", "data": {"data": [record], "meta_info": {}}})

    async def garbage(request: web.Request) -> web.Response:
        return web.Response(body=b"\x05\x00\x00\x00{}", content_type=packed_read.CONTENT_TYPE)

    app = web.Application()
    app.router.add_post("/get_rollout_data", json_only)
    app.router.add_post("/bad/get_rollout_data", garbage)
    url = tiny_server(app)
    got, _, _ = await fetch_rollout_data(url, None, 5.0)
    assert got == [record] and packed_read.wants_packed(accepts[0]), "asked for packed, read the JSON answer"
    with pytest.raises(ValueError, match="malformed packed body: envelope"):
        await fetch_rollout_data(url + "/bad", None, 5.0)


def test_array_records_skip_per_token_validation(monkeypatch: pytest.MonkeyPatch, qwen_tokenizer: Any) -> None:
    record = tool_trajectory(qwen_tokenizer, "i0", 1, exact32=False)
    arrays = {**record, "turns": [{k: np.asarray(v) if k.endswith(("_ids", "logprobs")) else v for k, v in t.items()}
                                  for t in record["turns"]]}
    expected, _ = build_samples(record, lambda: None)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a turn was validated token by token")

    monkeypatch.setattr(Turn, "model_validate", refuse)
    samples, stats = build_samples(arrays, lambda: None)
    assert [s.to_dict() for s in samples] == [s.to_dict() for s in expected] and stats.token_path_records == 1
    with pytest.raises(AssertionError, match="token by token"):
        build_token_pieces(record["turns"])  # the patch is live: lists still go through the model
    bad = {**arrays, "turns": [{**arrays["turns"][0], "output_logprobs": np.zeros(1)}]}
    with pytest.raises(ValueError, match=r"turns\[0\].output_logprobs has 1 values"):
        build_samples(bad, lambda: None)


def _version(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(value) if isinstance(value, str) and value.isdecimal() else None


def reference_pieces(turns: list[dict[str, Any]], mask_offpolicy: bool) -> list[dict[str, Any]]:
    """The token path's rule on plain lists, one token at a time (module docstring of token_path)."""
    def versions(turn: dict[str, Any]) -> list[int | None]:
        if turn.get("version_spans"):
            return [_version(v) for v, n in turn["version_spans"] for _ in range(n)]
        return [_version(turn.get("weight_version"))] * len(turn["output_ids"])

    known = [v for t in turns for v in versions(t) if v is not None]
    newest = max(known) if mask_offpolicy and known else None
    pieces: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for turn in turns:
        prompt, output = list(turn["prompt_ids"]), list(turn["output_ids"])
        if current is not None and prompt[:len(current["tokens"])] == current["tokens"]:
            context = prompt[len(current["tokens"]):]
            current["tokens"] += context
            current["mask"] += [0] * len(context)
            current["lp"] += [0.0] * len(context)
        else:
            if current is not None:
                pieces.append(current)
            current = {"tokens": prompt, "prompt_length": len(prompt), "mask": [], "lp": [], "has_lp": True, "off": 0}
        mask = [0 if newest is not None and v is not None and v < newest else 1 for v in versions(turn)]
        current["off"] += mask.count(0)
        current["tokens"] += output
        current["mask"] += mask
        if turn["output_logprobs"] is None:
            current["has_lp"] = False
            current["lp"] += [0.0] * len(output)
        else:
            current["lp"] += list(turn["output_logprobs"])
    assert current is not None
    pieces.append(current)
    return [{"tokens": p["tokens"], "prompt_length": p["prompt_length"], "loss_mask": p["mask"],
             "rollout_log_probs": p["lp"] if p["has_lp"] else None, "offpolicy_masked": p["off"]} for p in pieces]


drawn_turn = st.fixed_dictionaries({
    "extend": st.booleans(),
    "tail": st.lists(st.integers(0, 50), max_size=5),
    "output": st.lists(st.integers(0, 50), min_size=1, max_size=6),
    "logprobs": st.booleans(),
    "version": st.sampled_from([None, 1, 2, "3", "default"]),
    "spans": st.booleans(),
})


@settings(max_examples=150, deadline=None)
@given(drawn=st.lists(drawn_turn, min_size=1, max_size=5), mask_offpolicy=st.booleans(), seed=st.integers(0, 999))
def test_token_path_on_arrays_and_lists_follows_the_reference(drawn: list[dict[str, Any]], mask_offpolicy: bool,
                                                              seed: int) -> None:
    rng = np.random.default_rng(seed)
    turns: list[dict[str, Any]] = []
    history: list[int] = []
    for d in drawn:
        prompt = history + d["tail"] if d["extend"] and turns else d["tail"]
        output = d["output"]
        turn: dict[str, Any] = {"prompt_ids": prompt, "output_ids": output, "weight_version": d["version"],
                                "output_logprobs": (-3 * rng.random(len(output))).tolist() if d["logprobs"] else None,
                                "finish_reason": "stop"}
        if d["spans"] and len(output) > 1:
            turn["version_spans"] = [[1, 1], [None if d["version"] is None else 2, len(output) - 1]]
        turns.append(turn)
        history = prompt + output
    arrays = [{**t, "prompt_ids": np.asarray(t["prompt_ids"], dtype=np.int32),
               "output_ids": np.asarray(t["output_ids"], dtype=np.int32),
               "output_logprobs": None if t["output_logprobs"] is None else np.asarray(t["output_logprobs"])}
              for t in turns]
    expected = reference_pieces(turns, mask_offpolicy)
    for given_turns in (turns, arrays):
        pieces = build_token_pieces(given_turns, mask_offpolicy=mask_offpolicy).pieces
        got = [{"tokens": p.tokens, "prompt_length": p.prompt_length, "loss_mask": p.loss_mask,
                "rollout_log_probs": p.rollout_log_probs, "offpolicy_masked": p.offpolicy_masked} for p in pieces]
        assert got == expected
        assert all(type(x) is int for p in pieces for x in p.tokens + p.loss_mask)
