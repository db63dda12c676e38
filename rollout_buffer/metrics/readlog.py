"""Per-read summaries: what each read handed the trainer, kept in a bounded list per run (`keys.read_log`).

A summary says when, how many groups and samples, the reward's mean, quantiles and a 10-bin histogram of
the samples returned (`raw_reward` where a group hook normalised `reward`, so a GRPO run shows its success
rate, not zeros), the staleness summary the read reported (`meta_info["staleness"]`, when the run has
one), and how long its groups had waited since completion. The same script call adds each group's wait
to the `handover_seconds` histogram, so a read costs one extra Redis call. Retries of a leased batch are
not logged again. The last `MAX_READS` summaries are kept.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from rollout_buffer.metrics.histograms import HANDOVER_DELAY
from rollout_buffer.store import keys
from rollout_buffer.store.handover import ReadBatch
from rollout_buffer.store.once import ONCE_LUA, new_token
from rollout_buffer.store.store import Store

MAX_READS = 1000
REWARD_BINS = 10

# KEYS: 1 meta 2 stats 3 read_log. ARGV: 1 summary JSON 2 entries kept, then (stats field, amount) pairs.
# Appends the summary and adds the counters unless the run is gone (its keys are never re-created).
RECORD_READ = ONCE_LUA + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'deleted' then return 0 end
if not first_call(KEYS[4], ARGV[3]) then return 0 end  -- this call, re-sent by the client library: logged already
redis.call('RPUSH', KEYS[3], ARGV[1])
redis.call('LTRIM', KEYS[3], -tonumber(ARGV[2]), -1)
for i = 4, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
end
return 1
"""


def reward_of(record: dict[str, Any]) -> float | None:
    """The reward a person watches: `raw_reward` when the record has one (before normalisation), else `reward`."""
    for name in ("raw_reward", "reward"):
        value = record.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
            return float(value)
    return None


def reward_summary(values: Sequence[float]) -> dict[str, Any] | None:
    """Mean, min, max, p10/p50/p90 and a histogram (`edges`, `counts`) of one read's rewards."""
    if not values:
        return None
    array = np.asarray(values, dtype=float)
    low, high = float(array.min()), float(array.max())
    counts, edges = np.histogram(array, bins=REWARD_BINS if high > low else 1,
                                 range=(low, high) if high > low else (low - 0.5, low + 0.5))
    p10, p50, p90 = (float(x) for x in np.percentile(array, [10, 50, 90]))
    return {"mean": float(array.mean()), "min": low, "max": high, "p10": p10, "p50": p50, "p90": p90,
            "hist": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}}


def handover_delays(batch: ReadBatch, now: float) -> list[float]:
    """Per group: seconds since its newest record was made (its completion), never negative."""
    delays = []
    for group in batch.groups:
        stamps = [r["timestamp"] for r in group.records if isinstance(r.get("timestamp"), (int, float))]
        if stamps:
            delays.append(max(0.0, now - max(stamps)))
    return delays


def summarize(batch: ReadBatch, records: list[dict[str, Any]], meta: dict[str, Any],
              now: float) -> tuple[dict[str, Any], dict[str, int]]:
    """(the read's summary, the stats counters it adds)."""
    delays = handover_delays(batch, now)
    rewards = [r for r in (reward_of(record) for record in records) if r is not None]
    statuses: dict[str, int] = {}
    for record in records:
        status = str(record.get("status") or "completed")
        statuses[status] = statuses.get(status, 0) + 1
    summary = {
        "t": now, "batch_id": batch.batch_id or None, "leased": batch.kind == "leased",
        "groups": len(batch.groups), "samples": len(records),
        "filtered_groups": len(meta.get("filtered_groups") or []),
        "failed_groups": len(meta.get("failed_groups") or []),
        "timed_out_groups": len(meta.get("timed_out_groups") or []),
        "status_counts": statuses,
        "reward": reward_summary(rewards),
        "staleness": meta.get("staleness"),
        "handover_delay_s": {"mean": sum(delays) / len(delays), "max": max(delays)} if delays else None,
    }
    counters: dict[str, int] = {"reads_with_data": 1}
    for delay in delays:
        HANDOVER_DELAY.observe(counters, delay)
    return summary, counters


async def record_read(store: Store, run_id: str, batch: ReadBatch, records: list[dict[str, Any]],
                      meta: dict[str, Any]) -> None:
    """Log a read that handed groups over (first reads of a batch only: a retry is the same read)."""
    if batch.kind not in ("handed", "leased") or not batch.groups:
        return
    summary, counters = summarize(batch, records, meta, time.time())
    script = store.redis.register_script(RECORD_READ)
    args: list[Any] = [orjson.dumps(summary, option=orjson.OPT_SERIALIZE_NUMPY), MAX_READS, new_token()]
    for name, amount in counters.items():
        args.extend((name, amount))
    await script(keys=[keys.run_meta(run_id), keys.stats(run_id), keys.read_log(run_id),
                       keys.once(run_id)], args=args)


async def recent_reads(store: Store, run_id: str, count: int = 200) -> list[dict[str, Any]]:
    """The last `count` read summaries, oldest first."""
    return [orjson.loads(raw) for raw in await store.redis.lrange(keys.read_log(run_id), -count, -1)]
