"""Always on: what slime's generator example (`slime_plugins/rollout_buffer/generator/base_generator.py`) and
its buffer client (`rollout_buffer_example.py`) rely on, written from slime's source as facts, run against
`rollout-buffer serve` with a module of our own that does what the example does. The SLIME_DIR tier
(test_slime_generator_tier.py) runs slime's own files.

Facts from slime's source:
- the example is a legacy module: `TASK_TYPE = "math"` (a built-in's type here) and `run_rollout(data)`,
  reading `remote_engine_url` (it appends `/v1`), `remote_buffer_url`, `sampling_params["max_tokens"]`,
  `num_repeat_per_sample`, `num_process`, `task_type`, `input_file`, `num_epoch`, `skip_instance_ids`;
- it asks the engine through the OpenAI SDK (`model="custom"`, a `seed`, `tools=None`, the sampling params)
  and posts `{uid, messages, reward, instance_id, extra_info}` to `{remote_buffer_url}/buffer/write`, with
  its own `timestamp` (text) inside `extra_info` and none at the top;
- the client starts the run with every number as text, polls `POST /get_rollout_data` with `{}`, needs
  `uid, instance_id, messages, reward, extra_info` in each item, `float()`s `item["timestamp"]` when the key
  is there, sums `meta_info` `total_samples`/`avg_reward`, keeps `meta_info["finished_groups"]`, and reads
  `extra_info["finish_reason"] == "length"` as truncated.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.helpers import ServerProcess, write_jsonl
from tests.support.process_tools import wait_for

GROUP = 2
# Our own module, doing what slime's example does with the same payload keys and the same wire.
EXAMPLE_LIKE = '''
import json, random, time, uuid

import httpx
from openai import OpenAI

TASK_TYPE = "math"


def run_rollout(data):
    engine = data["remote_engine_url"].rstrip("/") + "/v1"
    client = OpenAI(api_key="test", base_url=engine)
    params = {"top_p": 1, **data["sampling_params"], "max_tokens": int(data["sampling_params"]["max_tokens"])}
    skip = list(data.get("skip_instance_ids") or [])
    seen = {"keys": sorted(data), "num_process": int(data.get("num_process", 100)), "task_type": data["task_type"]}
    for _ in range(int(data.get("num_epoch", 1))):
        for i, line in enumerate(open(data["input_file"])):
            item = json.loads(line)
            item.setdefault("instance_id", i)
            for _ in range(int(data["num_repeat_per_sample"])):
                response = client.chat.completions.create(messages=item["prompt"], model="custom", stream=False,
                                                          seed=random.randint(1, 10000000), tools=None, **params)
                choice = response.choices[0]
                messages = item["prompt"] + [{"role": "assistant", "content": choice.message.content}]
                extra = {"label": item["label"], "timestamp": str(time.time()), "finish_reason": choice.finish_reason,
                         "round_number": 1, "rollout_index": 1, "seen": seen, **params}
                reward = 1.0 if item["label"] in (choice.message.content or "") else 0.0
                record = {"uid": str(uuid.uuid4()), "messages": messages, "reward": reward,
                          "instance_id": item["instance_id"], "extra_info": extra}
                httpx.post(data["remote_buffer_url"].rstrip("/") + "/buffer/write", json=record, timeout=30)
'''


def _start_payload(server: ServerProcess, engine_url: str, input_file: Path, tokenizer: str) -> dict[str, Any]:
    """What slime's `start_rollout` sends: numbers as text, sampling params as numbers."""
    return {"num_process": "4", "num_epoch": "1", "remote_engine_url": engine_url, "remote_buffer_url": server.url,
            "task_type": "math", "input_file": str(input_file), "num_repeat_per_sample": str(GROUP),
            "max_tokens": "64", "sampling_params": {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0},
            "tokenizer_path": tokenizer, "skip_instance_ids": []}


def test_an_example_like_generator_feeds_a_client_reading_as_slimes_does(rollout_engine: Any, tmp_path: Path,
                                                                         qwen_tokenizer_path: str) -> None:
    tasks = tmp_path / "generator"
    tasks.mkdir()
    (tasks / "base_generator.py").write_text(EXAMPLE_LIKE)
    # integer instance ids as slime's data files carry them; prompts as chat messages
    rows = [{"instance_id": i, "label": str(2 * i), "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]}
            for i in range(2)]
    input_file = write_jsonl(tmp_path / "math.jsonl", rows)
    before = time.time()
    with ServerProcess(tmp_path / "data", "--task-dir", str(tasks)) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        active = client.get("/tasks").json()["tasks"]["math"]
        assert active["path"] == str(tasks / "base_generator.py") and active["kind"] == "legacy"
        started = client.post("/start_rollout", json=_start_payload(server, rollout_engine.url, input_file,
                                                                    qwen_tokenizer_path))
        assert started.status_code == 200, started.text
        reads: list[dict[str, Any]] = []

        def read() -> bool:
            answer = client.post("/get_rollout_data", json={}).json()  # slime's client names no run
            if answer["success"]:
                reads.append(answer["data"])
            return sum(len(r["data"]) for r in reads) == 2 * GROUP

        wait_for(read, timeout_s=60, what="both groups handed to a client reading as slime's does")
    items = [item for r in reads for item in r["data"]]
    for item in items:
        assert {"uid", "instance_id", "messages", "reward", "extra_info"} <= set(item)
        assert before <= float(item["timestamp"]) <= time.time(), "stamped when stored: slime float()s it"
        assert item["extra_info"]["finish_reason"] in ("stop", "length")
        assert item["extra_info"]["rollout_index"] == 1 and float(item["extra_info"]["timestamp"]) >= before
    assert sorted(item["instance_id"] for item in items) == ["0", "0", "1", "1"], "ids as text"
    finished = [g for r in reads for g in r["meta_info"]["finished_groups"]]
    assert sorted(finished) == ["0", "1"]
    assert sum(r["meta_info"]["total_samples"] for r in reads) == 2 * GROUP
    assert all("avg_reward" in r["meta_info"] for r in reads)
    seen = items[0]["extra_info"]["seen"]
    assert seen["num_process"] == 4 and seen["task_type"] == "math"
    assert {"remote_engine_url", "remote_buffer_url", "sampling_params", "num_repeat_per_sample", "input_file",
            "num_epoch", "skip_instance_ids", "num_process", "task_type"} <= set(seen["keys"])
    assert rollout_engine.stats.requests >= 2 * GROUP
