"""Bounded memory in long runs: the tokenizer cache keeps the most recently used few, and the legacy
runner forgets a run's thread once its `run_rollout` returned (the soak in bench/soak.py measures the
whole server)."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from rollout_buffer.runs.lifecycle import RunSpec
from rollout_buffer.runtime import tokenizers
from rollout_buffer.runtime.legacy import LegacyRunner
from rollout_buffer.store.store import Store
from rollout_buffer.tasks.discovery import TaskModule
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
from rollout_buffer.wire.schema import StartRolloutRequest
from tests.support.doc_pages import all_docs


def test_the_tokenizer_cache_keeps_the_most_recently_used(monkeypatch: pytest.MonkeyPatch) -> None:
    documented = " ".join(all_docs().split())
    assert f"keeps the {tokenizers.CACHE_SIZE} most recently used tokenizers" in documented, "docs/security.md"
    monkeypatch.setattr(tokenizers, "CACHE_SIZE", 2)
    monkeypatch.setattr(tokenizers, "_cache", OrderedDict())
    a, b, c = (str(qwen_tokenizer_dir(t)) for t in ("qwen2.5", "qwen3", "r1_distill"))
    first = tokenizers.load_tokenizer(a)
    tokenizers.load_tokenizer(b)
    assert tokenizers.load_tokenizer(a) is first, "a hit returns the cached object"
    tokenizers.load_tokenizer(c)  # evicts b, the least recently used
    assert tokenizers.cached_paths() == [a, c]
    assert asyncio.run(tokenizers.get_tokenizer(c)) is tokenizers.load_tokenizer(c)
    assert tokenizers.cached_paths() == [a, c]


def test_a_hub_name_is_not_fetched_without_downloads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setattr(tokenizers, "_cache", OrderedDict())
    with pytest.raises(OSError):
        tokenizers.load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")  # would need the network: refused offline


def _spec(run_id: str, run_rollout: Any) -> RunSpec:
    module = types.ModuleType(f"legacy_{run_id}")
    module.run_rollout = run_rollout  # type: ignore[attr-defined]
    request = StartRolloutRequest(task_type="legacy_unit", input_file="x", remote_buffer_url="http://127.0.0.1:9")
    return RunSpec(run_id=run_id, request=request, task=TaskModule("legacy_unit", Path("x"), module), created=True)


async def test_the_legacy_runner_keeps_only_live_threads(redis_store: Store) -> None:
    runner = LegacyRunner(redis_store)
    release = threading.Event()
    seen: list[str] = []

    def quick(data: dict[str, Any]) -> None:
        seen.append(data["remote_buffer_url"])

    def slow(data: dict[str, Any]) -> None:
        release.wait(30)

    run_ids = [f"legacy-{i}" for i in range(20)]
    for run_id in [*run_ids, "legacy-slow"]:
        await redis_store.create_run(run_id, {}, group_size=1, num_epoch=1, task_type="legacy_unit")
    for run_id in run_ids:
        assert runner.launch(_spec(run_id, quick), write_url=f"http://w/{run_id}")
    assert runner.launch(_spec("legacy-slow", slow))
    assert not runner.launch(_spec("legacy-slow", slow)), "one live thread per run"
    deadline = time.monotonic() + 30
    while [r for r in run_ids if (await redis_store.run_meta(r)).get("status") != "finished"]:
        assert time.monotonic() < deadline, "legacy runs did not finish"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)  # the watchers run after the status is set
    assert runner.live_runs == ["legacy-slow"], "finished runs leave nothing behind"
    assert sorted(seen) == sorted(f"http://w/{r}" for r in run_ids), "each module got its own write URL"
    release.set()
    deadline = time.monotonic() + 30
    while runner.live_runs:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    await runner.shutdown()
