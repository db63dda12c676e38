"""A run's creation cut short by a killed API is completed by the next `/start_rollout`.

Found by `python -m bench.chaos --minutes 10 --seed 7`: the API was SIGKILLed between writing a new
generation's entry in the run index and its meta; every later `/start_rollout` found the run indexed,
took it for existing, and never wrote its meta, so no worker served it (no status) and the trainer waited
for it forever.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from rollout_buffer.store import keys
from rollout_buffer.store.embedded import EmbeddedRedis
from rollout_buffer.store.store import Store


async def test_an_indexed_run_without_meta_is_created_again(tmp_path: Path) -> None:
    embedded = EmbeddedRedis(tmp_path)
    store = Store.from_url(embedded.start())
    try:
        await store.redis.hset(keys.RUNS, "cut-short", orjson.dumps({"run_id": "cut-short"}))  # index only
        assert await store.create_run("cut-short", {"run_id": "cut-short"}, group_size=2, num_epoch=1,
                                      task_type="math"), "taken as new: its meta was never written"
        assert await store.run_status("cut-short") == "running"
        assert (await store.run_meta("cut-short"))["group_size"] == "2"
        assert not await store.create_run("cut-short", {"run_id": "cut-short"}, group_size=4, num_epoch=1,
                                          task_type="math"), "a run with meta exists: its settings are kept"
        assert (await store.run_meta("cut-short"))["group_size"] == "2"
    finally:
        await store.close()
        embedded.stop()
