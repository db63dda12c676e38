"""The slime tier, generator side: slime's own generator example
(`slime_plugins/rollout_buffer/generator/base_generator.py`, in `$SLIME_DIR`, as it is there) is the server's
task module, and slime's own buffer client (`rollout_buffer_example.py`) trains from what it writes.

The example declares `TASK_TYPE = "math"`, a built-in's type: the server's `--task-dir` points at slime's
generator folder unchanged, and the module there replaces the built-in (tests/tasks/test_task_override.py).
It imports slime's reward functions, which import torch (the stand-in package in
`tests/support/torch_path`, on the server's PYTHONPATH only) and sympy/pylatexenc (slime's own
requirements). Without `SLIME_DIR` (or those two) the test is skipped saying so;
`tests/adapter/test_slime_generator_contract.py` checks what the example relies on, from slime's source as
facts, on every run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slime_adapter.hooks.agent_rollout import reset_state
from tests.support.helpers import REPO, ServerProcess, SlimeLikeDataBuffer, write_jsonl
from tests.support.process_tools import all_gone, children
from tests.support.slime_namespace import slime_namespace
from tests.support.torch_standin import TORCH_PATH, real_slime, slime_dir_or_skip

GROUP = 2
SERVE_MARK = "rollout_buffer.cli serve"  # the generator's forked processes keep the server's command line


@pytest.fixture()
def slime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """slime's modules from `$SLIME_DIR` in this process (skipped without it)."""
    missing = [name for name in ("sympy", "pylatexenc") if importlib.util.find_spec(name) is None]
    if missing:
        slime_dir_or_skip()
        pytest.skip(f"slime's reward functions, imported by its generator example, need {missing} (slime's own "
                    "requirements; pip install '.[slime-tier]')")
    reset_state()
    yield from real_slime(monkeypatch)
    reset_state()


@pytest.fixture()
def generator_server(slime: Any, tmp_path: Path) -> Iterator[ServerProcess]:
    """`rollout-buffer serve --task-dir $SLIME_DIR/slime_plugins/rollout_buffer/generator`; the processes the
    generator forks (they outlive a run: the example sleeps 300 s between its repeats) are ended by pid."""
    slime_dir = os.environ["SLIME_DIR"]
    folder = Path(slime_dir) / "slime_plugins" / "rollout_buffer" / "generator"
    path = os.pathsep.join([str(REPO), str(TORCH_PATH), slime_dir, os.environ.get("PYTHONPATH", "")])
    server = ServerProcess(tmp_path / "data", "--task-dir", str(folder), env={"PYTHONPATH": path})
    with server:
        yield server
        assert server.proc is not None
        forked = children(server.proc.pid, SERVE_MARK)
        for pid in forked:
            os.kill(pid, signal.SIGKILL)
        all_gone(forked, timeout_s=15)


def test_slimes_generator_example_feeds_slimes_buffer_client(slime: Any, generator_server: ServerProcess,
                                                             rollout_engine: Any, qwen_tokenizer_path: str,
                                                             tmp_path: Path) -> None:
    from slime_plugins.rollout_buffer import rollout_buffer_example as example

    listed = httpx.get(f"{generator_server.url}/tasks", timeout=10).json()
    assert listed["tasks"]["math"]["path"].endswith("slime_plugins/rollout_buffer/generator/base_generator.py")
    assert listed["tasks"]["math"]["kind"] == "legacy" and listed["tasks"]["math"]["source"] == "task-dir"
    assert listed["errors"] == {}, "slime's generator imports in the server (torch stood in)"

    rows = [{"instance_id": str(i), "label": str(2 * i),
             "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(2)]
    args = slime_namespace(
        rollout_buffer_url=generator_server.url, engine_url=rollout_engine.url, rollout_task_type="math",
        prompt_data=str(write_jsonl(tmp_path / "math.jsonl", rows)), hf_checkpoint=qwen_tokenizer_path,
        n_samples_per_prompt=GROUP, rollout_batch_size=2, num_epoch=1, rollout_max_response_len=64,
        rollout_num_process=4, fetch_trajectory_retry_times=5, loss_mask_type="qwen", use_wandb=False,
        use_tensorboard=False)
    buffer = SlimeLikeDataBuffer()
    # the example's run_rollout waits 10 s for the buffer before it starts, the client polls every 5 s
    groups = asyncio.run(asyncio.wait_for(example.generate_rollout_async(args, 0, buffer), timeout=150))
    assert len(groups) == 2 and all(len(g) == GROUP for g in groups)
    assert sorted(g[0].index for g in groups) == ["0", "1"]
    for sample in (s for g in groups for s in g):
        assert type(sample) is slime.Sample
        assert len(sample.loss_mask) == sample.response_length > 0 and 1 in sample.loss_mask
        # written by the example's worker_process: its extra_info, rewarded by slime's deepscaler rule
        assert sample.metadata["rollout_index"] == 1 and sample.metadata["round_number"] == 1
        assert sample.metadata["finish_reason"] in ("stop", "length") and sample.reward in (0, 1)
    assert sorted(buffer.metadata["0"]) == ["0", "1"], "slime's client records the finished groups it read"
    engine_calls = rollout_engine.stats.requests
    assert engine_calls >= 2 * GROUP, "every record came from a chat completion at the test engine"
