"""`generate_rollout` as slime calls it, step by step, with a slime-like data buffer.

The buffer is a real `rollout-buffer serve` process whose records the test writes (tasks "external" and
"graded", no engine needed); tiny aiohttp apps stand in for buffers that misbehave.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from aiohttp import web

from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from slime_adapter.hooks.agent_rollout import (
    GroupSizeMismatchError,
    RolloutDataUnavailable,
    SampleBuildError,
    generate_rollout,
)
from slime_adapter.samples.sample import Sample
from tests.support.helpers import ServerProcess, ServerSpec, SlimeLikeDataBuffer, make_record, write_jsonl
from tests.support.process_tools import wait_for

SYSTEM = [{"role": "user", "content": "What is 6*7?"}]
SERVER = ServerSpec(shared="external_buffer")


@pytest.fixture()
def input_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}", "prompt": f"p{i}"} for i in range(8)])


def slime_args(url: str, input_file: Path, **extra: Any) -> SimpleNamespace:
    values: dict[str, Any] = {
        "agent_rollout_buffer_url": url, "rollout_task_type": "external", "prompt_data": str(input_file),
        "n_samples_per_prompt": 2, "rollout_batch_size": 2, "num_epoch": 1, "rollout_num_process": 4,
        "hf_checkpoint": str(qwen_tokenizer_dir("qwen2.5")), "loss_mask_type": "qwen",
        "agent_fetch_timeout_s": 5.0, "agent_fetch_backoff_s": 0.05, "fetch_trajectory_retry_times": 20,
    }
    values.update(extra)
    return SimpleNamespace(**values)


def token_record(tok: Any, instance_id: str, reward: float, **extra: Any) -> dict[str, Any]:
    """A record with the engine's own tokens (`turns`), as the runtime writes them."""
    prompt = tok.apply_chat_template(SYSTEM, tokenize=True, return_dict=False, add_generation_prompt=True)
    output = tok.encode("42", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    turn = {"prompt_ids": prompt, "output_ids": output, "output_logprobs": [-0.5] * len(output),
            "finish_reason": "stop", "weight_version": "3"}
    messages = [*SYSTEM, {"role": "assistant", "content": "42"}]
    return make_record(instance_id, reward=reward, messages=messages, turns=[turn], **extra)


def check_sample(sample: Any) -> None:
    assert len(sample.loss_mask) == sample.response_length
    assert sample.rollout_log_probs is None or len(sample.rollout_log_probs) == sample.response_length
    assert 0 < sample.response_length <= len(sample.tokens) and sum(sample.loss_mask) > 0


def start_external(client: httpx.Client, input_file: Path, run_id: str) -> None:
    """An external run of groups of two, records written by the test."""
    body = {"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": 2, "run_id": run_id}
    assert client.post("/start_rollout", json=body).status_code == 200


def lease_state(client: httpx.Client, run_id: str) -> dict[str, int]:
    """The run's lease counters and group counts, in one dict."""
    detail = client.get(f"/runs/{run_id}").json()
    return {**detail["leases"], **detail["groups"]}


def write_all(url: str, run_id: str, records: list[dict[str, Any]]) -> None:
    with httpx.Client(base_url=url, timeout=10) as client:
        for record in records:
            response = client.post("/buffer/write", json={**record, "run_id": run_id})
            assert response.status_code == 200 and response.json()["success"], response.text


def test_two_steps_with_normalised_then_raw_rewards_and_a_filtered_group(
        server: ServerProcess, input_file: Path, qwen_tokenizer: Any, slime_data_buffer: Any) -> None:
    args = slime_args(server.url, input_file, rollout_task_type="graded", agent_rollout_run_id="graded-1")
    buffer = slime_data_buffer()
    with httpx.Client(base_url=server.url, timeout=10) as client:  # the run must exist before records arrive
        body = {"task_type": "graded", "input_file": str(input_file), "num_repeat_per_sample": 2, "run_id": "graded-1"}
        assert client.post("/start_rollout", json=body).status_code == 200
    write_all(server.url, "graded-1", [
        make_record("i0", reward=0.0), make_record("i0", reward=0.0),  # all zero: filtered by the task's hook
        make_record("i1", reward=1.0), make_record("i1", reward=3.0),
        token_record(qwen_tokenizer, "i2", 2.0), token_record(qwen_tokenizer, "i2", 0.0),
    ])
    groups = generate_rollout(args, 0, buffer)
    assert [[s.metadata["instance_id"] for s in g] for g in groups] == [["i1", "i1"], ["i2", "i2"]]
    assert buffer.metadata == {"0": {"groups": ["0:i0", "0:i1", "0:i2"]}}, "the filtered group is finished too"
    assert buffer.get_buffer_length() == 0
    for group in groups:
        assert sorted(s.reward for s in group) == pytest.approx([-1.0, 1.0], abs=1e-5), "normalised rewards"
        assert len({s.group_index for s in group}) == 1
        for sample in group:
            check_sample(sample)
            assert isinstance(sample, Sample) and sample.status == Sample.Status.COMPLETED
    assert sorted(s.metadata["raw_reward"] for s in groups[0]) == [1.0, 3.0]
    assert {s.metadata["mask_source"] for s in groups[0]} == {"retokenized"}
    token_sample = groups[1][0]
    assert token_sample.metadata["mask_source"] == "tokens" and token_sample.rollout_log_probs[-1] == -0.5
    assert token_sample.tokens == qwen_tokenizer.apply_chat_template(
        SYSTEM, tokenize=True, return_dict=False, add_generation_prompt=True) + token_sample.tokens[-3:]
    assert groups[0][0].group_index != groups[1][0].group_index

    write_all(server.url, "graded-1", [make_record(f"i{i}", reward=r) for i in (3, 4) for r in (1.0, 3.0)])
    raw_args = slime_args(server.url, input_file, rollout_task_type="graded", agent_rollout_run_id="graded-1",
                          disable_rewards_normalization=True)
    groups = generate_rollout(raw_args, 1, buffer)
    assert [g[0].metadata["instance_id"] for g in groups] == ["i3", "i4"]
    assert [sorted(s.reward for s in g) for g in groups] == [[1.0, 3.0], [1.0, 3.0]], "raw rewards"
    assert buffer.metadata == {"0": {"groups": ["0:i0", "0:i1", "0:i2"]}, "1": {"groups": ["0:i3", "0:i4"]}}


def test_fetch_gives_up_after_the_configured_retries(server: ServerProcess, input_file: Path,
                                                     slime_data_buffer: Any) -> None:
    args = slime_args(server.url, input_file, agent_rollout_run_id="idle", fetch_trajectory_retry_times=2,
                      agent_fetch_timeout_s=0.3)
    buffer = slime_data_buffer()
    began = time.monotonic()
    with pytest.raises(RolloutDataUnavailable, match=r"3 consecutive fetch\(es\).*no group ready.*0/2 group"):
        generate_rollout(args, 0, buffer)
    assert time.monotonic() - began < 5.0
    assert buffer.get_buffer_length() == 0 and buffer.metadata == {}


def test_a_step_slower_than_its_lease_keeps_its_groups(server: ServerProcess, input_file: Path,
                                                       slime_data_buffer: Any) -> None:
    """The trainer side takes several lease lengths to take in a batch (here: a data buffer that blocks until
    released): the adapter renews the lease in the background, so no other read gets the held group."""
    args = slime_args(server.url, input_file, agent_rollout_run_id="slow-step", agent_lease_s=1.0,
                      rollout_batch_size=1, num_rollout=1)  # the last step: acknowledged before it returns
    gate = threading.Event()

    class SlowBuffer(slime_data_buffer):  # type: ignore[misc,valid-type]
        def add_samples(self, samples: list[list[Any]]) -> None:
            assert gate.wait(30), "the test never released the step"
            super().add_samples(samples)

    buffer = SlowBuffer()
    with httpx.Client(base_url=server.url, timeout=10) as client:
        start_external(client, input_file, "slow-step")
        write_all(server.url, "slow-step", [make_record("i0"), make_record("i0")])
        run_state = functools.partial(lease_state, client, "slow-step")
        with ThreadPoolExecutor(1) as pool:
            step = pool.submit(generate_rollout, args, 0, buffer)
            wait_for(lambda: run_state()["leased"] == 1, 10.0, "the step holds the group")
            wait_for(lambda: run_state()["lease_renewals"] >= 6, 10.0, "renewals over two lease lengths")
            other = client.post("/get_rollout_data", json={"run_id": "slow-step", "lease_s": 60}).json()
            assert not other["success"], "the held group is not handed to another read"
            held = run_state()
            assert (held["lease_expired"], held["leased"]) == (0, 1)
            gate.set()
            groups = step.result(timeout=30)
        assert [g[0].metadata["instance_id"] for g in groups] == ["i0"]
        after = run_state()
        assert (after["lease_expired"], after["leased"], after["consumed"]) == (0, 0, 1), after


def test_a_batch_is_acknowledged_by_the_next_steps_read_not_by_its_own(server: ServerProcess, input_file: Path,
                                                                       slime_data_buffer: Any) -> None:
    """A step whose groups arrive in two reads: its second read does not acknowledge the batch its first read
    took (a trainer killed while it waits for the rest would lose that group to a new generation of the
    run); the next step's first read acknowledges both. Found by the chaos run, where killed trainers
    waiting for their last step's second group made the run roll out a new generation each time."""
    args = slime_args(server.url, input_file, agent_rollout_run_id="two-reads", fetch_trajectory_retry_times=-1,
                      agent_fetch_timeout_s=0.3)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        start_external(client, input_file, "two-reads")
        write_all(server.url, "two-reads", [make_record("i0"), make_record("i0")])
        leases = functools.partial(lease_state, client, "two-reads")
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(generate_rollout, args, 0, slime_data_buffer())
            wait_for(lambda: leases()["leased"] == 1, 10.0, "the step holds its first group")
            time.sleep(1.0)  # reads for the second group go on meanwhile
            write_all(server.url, "two-reads", [make_record("i1"), make_record("i1")])
            groups = first.result(timeout=30)
        assert sorted(g[0].metadata["instance_id"] for g in groups) == ["i0", "i1"]
        held = leases()
        assert (held["batches_acked"], held["leased"]) == (0, 2), "both batches wait for the next step"
        write_all(server.url, "two-reads", [make_record(i) for i in ("i2", "i2", "i3", "i3")])
        generate_rollout(args, 1, slime_data_buffer())
        after = leases()
        assert (after["batches_acked"], after["leased"], after["consumed"]) == (2, 2, 2), after


def test_evaluation_without_eval_data_says_what_to_set(input_file: Path, slime_data_buffer: Any) -> None:
    with pytest.raises(ValueError, match="no eval dataset is configured.*--eval-prompt-data"):
        generate_rollout(slime_args("http://127.0.0.1:9", input_file), 0, slime_data_buffer(), evaluation=True)


class LegacyBuffer:
    """A buffer that ignores `num` and hands over every ready group: the source of surplus groups."""

    def __init__(self, reads: list[list[dict[str, Any]]], status: int = 200) -> None:
        self.reads = reads
        self.status = status
        self.start_bodies: list[dict[str, Any]] = []
        self.read_bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/start_rollout", self.start)
        app.router.add_post("/get_rollout_data", self.read)
        return app

    async def start(self, request: web.Request) -> web.Response:
        self.start_bodies.append(await request.json())
        return web.json_response({"message": "ok", "run_id": "legacy", "created": True, "skipped_instance_ids": 0})

    async def read(self, request: web.Request) -> web.Response:
        self.read_bodies.append(await request.json())
        if self.status != 200:
            return web.Response(status=self.status, text="overloaded")
        if not self.reads:
            return web.json_response({"success": False, "message": "no group is ready",
                                      "data": {"data": [], "meta_info": {}}})
        records = self.reads.pop(0)
        finished = list(dict.fromkeys(r["instance_id"] for r in records))
        meta = {"total_samples": len(records), "num_groups": len(finished), "avg_reward": 0.5,
                "finished_groups": finished, "filtered_groups": []}
        return web.json_response({"success": True, "message": "", "data": {"data": records, "meta_info": meta}})


def test_surplus_groups_stay_in_order_for_the_next_step(tiny_server: Any, input_file: Path, qwen_tokenizer: Any,
                                                        slime_data_buffer: Any) -> None:
    group = lambda i: [token_record(qwen_tokenizer, f"i{i}", r) for r in (0.0, 1.0)]
    legacy = LegacyBuffer([group(0) + group(1) + group(2), group(3)])
    url = tiny_server(legacy.app())
    buffer = slime_data_buffer({"7": ["x1", "x2"], "8": ["x2", "x3"]})
    args = slime_args(url, input_file)
    first = generate_rollout(args, 9, buffer)
    assert [g[0].metadata["instance_id"] for g in first] == ["i0", "i1"]
    assert buffer.get_buffer_length() == 1
    assert buffer.metadata["9"] == {"groups": [], "instance_ids": ["i0", "i1", "i2"]}, "a buffer without keys"
    second = generate_rollout(args, 10, buffer)
    assert [g[0].metadata["instance_id"] for g in second] == ["i2", "i3"], "the surplus group comes first"
    assert buffer.metadata["10"] == {"groups": [], "instance_ids": ["i3"]} and buffer.get_buffer_length() == 0
    assert len(legacy.start_bodies) == 1, "the run is started once per process"
    assert legacy.start_bodies[0]["skip_instance_ids"] == ["x1", "x2", "x2", "x3"], "one entry per trained group"
    assert legacy.start_bodies[0]["skip_groups"] == []
    assert [b.get("num") for b in legacy.read_bodies] == [4, 2], "the second step asks only for what is missing"
    assert all(b["run_id"] == "legacy" for b in legacy.read_bodies)


def test_a_group_that_cannot_be_built_raises_after_keeping_the_rest(tiny_server: Any, input_file: Path,
                                                                    qwen_tokenizer: Any, slime_data_buffer: Any) -> None:
    good = [token_record(qwen_tokenizer, "i0", r) for r in (0.0, 1.0)]
    bad = [make_record("i1", reward=r) for r in (0.0, 1.0)]  # message path, but no tokenizer configured
    url = tiny_server(LegacyBuffer([good + bad]).app())
    buffer = slime_data_buffer()
    with pytest.raises(SampleBuildError, match="instance i1.*hf_checkpoint") as info:
        generate_rollout(slime_args(url, input_file, hf_checkpoint=None), 0, buffer)
    assert [r["instance_id"] for r in info.value.records] == ["i1", "i1"]
    assert buffer.metadata == {"0": {"groups": [], "instance_ids": ["i0", "i1"]}} and buffer.get_buffer_length() == 1


def test_http_errors_count_as_failed_fetches(tiny_server: Any, input_file: Path, slime_data_buffer: Any) -> None:
    legacy = LegacyBuffer([], status=503)
    url = tiny_server(legacy.app())
    with pytest.raises(RolloutDataUnavailable, match="ClientResponseError.*503"):
        generate_rollout(slime_args(url, input_file, fetch_trajectory_retry_times=1), 0, slime_data_buffer())
    assert len(legacy.read_bodies) == 2
    assert json.loads(json.dumps(legacy.read_bodies[0]))["wait_s"] == pytest.approx(4.0)


class StrictDataBuffer(SlimeLikeDataBuffer):
    """slime's `RolloutDataSourceWithBuffer.add_samples`: every group must have n_samples_per_prompt samples."""

    def __init__(self, n_samples_per_prompt: int) -> None:
        super().__init__()
        self.n = n_samples_per_prompt

    def add_samples(self, samples: list[list[Any]]) -> None:
        for group in samples:
            assert len(group) == self.n, f"group of {len(group)} samples, n_samples_per_prompt is {self.n}"
        super().add_samples(samples)


def forked_record(tok: Any, instance_id: str, reward: float) -> dict[str, Any]:
    """Two engine calls; the second prompt was re-rendered and does not extend the first call's history."""
    record = token_record(tok, instance_id, reward)
    first = record["turns"][0]
    drifted = tok.encode(" " + tok.decode(first["prompt_ids"] + first["output_ids"]), add_special_tokens=False)
    out = tok.encode("Final: 42", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    record["turns"] = [first, {"prompt_ids": drifted, "output_ids": out, "output_logprobs": [-0.25] * len(out),
                               "finish_reason": "stop", "weight_version": "3"}]
    return record


def test_forked_record_keeps_the_group_size_slime_asserts(tiny_server: Any, input_file: Path, qwen_tokenizer: Any,
                                                          logged_metrics: list[dict[str, Any]]) -> None:
    tok = qwen_tokenizer
    forked = forked_record(tok, "i0", 1.0)
    group = [forked, token_record(tok, "i0", 0.0)]
    url = tiny_server(LegacyBuffer([group, [token_record(tok, "i1", r) for r in (0.0, 1.0)]]).app())
    buffer = StrictDataBuffer(n_samples_per_prompt=2)
    groups = generate_rollout(slime_args(url, input_file), 0, buffer)  # default agent_fork_policy: "last"
    assert [len(g) for g in groups] == [2, 2]
    kept = groups[0][0]
    assert kept.metadata["uid"] == forked["uid"] and kept.metadata["fork"] == 1 and kept.reward == 1.0
    assert kept.tokens[-len(forked["turns"][1]["output_ids"]):] == forked["turns"][1]["output_ids"]
    check_sample(kept)
    first_piece = len(forked["turns"][0]["prompt_ids"]) + len(forked["turns"][0]["output_ids"])
    (metrics,) = logged_metrics
    assert metrics["rollout/forks"] == 1 and metrics["rollout/fork_dropped_pieces"] == 1
    assert metrics["rollout/fork_dropped_tokens"] == first_piece
    assert metrics["rollout/fork_dropped_generated_tokens"] == len(forked["turns"][0]["output_ids"])
    assert metrics["rollout/group_size_mismatch"] == 0 and metrics["rollout/samples"] == 4


def test_fork_policy_all_keeps_every_piece(tiny_server: Any, input_file: Path, qwen_tokenizer: Any,
                                           slime_data_buffer: Any, logged_metrics: list[dict[str, Any]]) -> None:
    tok = qwen_tokenizer
    group = [forked_record(tok, "i0", 1.0), token_record(tok, "i0", 0.0)]
    url = tiny_server(LegacyBuffer([group]).app())
    args = slime_args(url, input_file, rollout_batch_size=1, agent_fork_policy="all")
    (samples,) = generate_rollout(args, 0, slime_data_buffer())
    assert len(samples) == 3 and [s.metadata.get("fork") for s in samples] == [0, 1, None]
    (metrics,) = logged_metrics
    assert metrics["rollout/group_size_mismatch"] == 1 and metrics["rollout/fork_dropped_pieces"] == 0


class BigGroupBuffer(LegacyBuffer):
    """Answers like the buffer does when `num` is smaller than its next ready group."""

    def __init__(self, group_size: int) -> None:
        super().__init__([])
        self.group_size = group_size

    async def read(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.read_bodies.append(body)
        return web.json_response({
            "success": False, "data": {"data": [], "meta_info": {}},
            "message": f"num={body['num']} is smaller than the next ready group ({self.group_size} records); "
                       "ask for at least one whole group"})


def test_num_smaller_than_the_next_group_raises_at_once(tiny_server: Any, input_file: Path,
                                                        slime_data_buffer: Any) -> None:
    legacy = BigGroupBuffer(group_size=4)
    url = tiny_server(legacy.app())
    args = slime_args(url, input_file, rollout_batch_size=1, fetch_trajectory_retry_times=-1)
    began = time.monotonic()
    with pytest.raises(GroupSizeMismatchError, match=r"group has 4 samples.*num=2.*n_samples_per_prompt=2") as info:
        generate_rollout(args, 0, slime_data_buffer())
    assert time.monotonic() - began < 3.0 and len(legacy.read_bodies) == 1, "no polling until a retry limit"
    assert (info.value.group_size, info.value.n_samples_per_prompt) == (4, 2)


def test_real_buffer_with_larger_groups_than_the_trainer_expects(server: ServerProcess, input_file: Path,
                                                                 slime_data_buffer: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:  # the buffer's run groups 4 per prompt
        body = {"task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": 4,
                "run_id": "groups-of-4"}
        assert client.post("/start_rollout", json=body).status_code == 200
    write_all(server.url, "groups-of-4", [make_record("i0", reward=float(r)) for r in range(4)])
    args = slime_args(server.url, input_file, agent_rollout_run_id="groups-of-4", rollout_batch_size=1,
                      n_samples_per_prompt=2, fetch_trajectory_retry_times=-1)
    with pytest.raises(GroupSizeMismatchError, match=r"group has 4 samples.*n_samples_per_prompt=2"):
        generate_rollout(args, 0, slime_data_buffer())
