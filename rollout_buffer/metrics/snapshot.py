"""One read of every live run's state from Redis, in one pipeline: what `/metrics`, the dashboard and
`rollout-buffer status` render. Runs come from the run index, so a deleted run is simply not there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from rollout_buffer.store import keys
from rollout_buffer.store.store import Store, number, text

# enough samples of the timeline for the current rates (the dashboard reads the whole list itself)
RECENT_POINTS = 3


@dataclass
class RunSnapshot:
    """One run as stored now."""

    run_id: str
    meta: dict[str, str]
    stats: dict[str, float]
    pending: int
    ready: int
    leased: int
    leased_batches: int
    lines: int
    recent_points: list[list[float]] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.meta.get("status", "")

    def stat(self, name: str) -> int:
        return int(self.stats.get(name, 0))

    @property
    def group_size(self) -> int:
        return int(self.meta.get("group_size") or 0)

    @property
    def num_epoch(self) -> int:
        return int(self.meta.get("num_epoch") or 0)

    def prefixed(self, prefix: str) -> dict[str, int]:
        """Counters named `<prefix><name>`, as {name: value}."""
        return {k[len(prefix):]: int(v) for k, v in self.stats.items() if k.startswith(prefix)}

    def gateway_sessions_open(self) -> int:
        """Agent gateway sessions created and not yet finished (by their client or the idle timeout)."""
        return max(0, self.stat("gateway_sessions_created") - self.stat("gateway_sessions_finished")
                   - self.stat("gateway_sessions_timed_out"))

    def tasks(self) -> dict[str, int]:
        """Tasks by state, and `total` (known once every task was enqueued; else what was enqueued so far)."""
        states = {name: self.stat(f"tasks_{name}") for name in ("queued", "running", "done", "failed", "skipped")}
        total = self.meta.get("tasks_total")
        states["total"] = int(total) if total else sum(states.values())
        return states

    def groups(self) -> dict[str, int]:
        """Groups by state: `pending` (incomplete), `ready`, `leased` now; `handed` over, `filtered` by the
        task's hooks, `timed_out` (closed by the group timeout, dropped or handed incomplete) so far."""
        return {
            "pending": self.pending, "ready": self.ready, "leased": self.leased,
            "handed": self.stat("groups_handed"), "filtered": self.stat("groups_filtered"),
            "timed_out": self.stat("drop:group_timeout") + self.stat("groups_timed_out_handed"),
            "completed": self.stat("groups_completed"),
        }

    def epochs(self) -> list[dict[str, int]]:
        """Per epoch: rollouts finished (done or failed) out of the epoch's `lines x repeats`. Empty for a
        run without a task plan here (legacy modules and external writers roll out on their own)."""
        per_epoch = self.lines * self.group_size
        if per_epoch == 0:
            return []
        done = self.prefixed("epoch_done:")
        return [{"epoch": e, "finished": done.get(str(e), 0), "total": per_epoch} for e in range(self.num_epoch)]


def _json_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


async def snapshot_runs(store: Store, run_ids: list[str] | None = None) -> list[RunSnapshot]:
    """Every live run (or `run_ids`), read in one round trip; runs whose meta is gone are left out."""
    if run_ids is None:
        run_ids = await store.list_runs()
    if not run_ids:
        return []
    per_run = 7
    async with store.redis.pipeline(transaction=False) as pipe:
        for run_id in run_ids:
            pipe.hgetall(keys.run_meta(run_id))
            pipe.hgetall(keys.stats(run_id))
            pipe.zcard(keys.pending(run_id))
            pipe.llen(keys.ready(run_id))
            pipe.hvals(keys.lease_data(run_id))
            pipe.hlen(keys.samples(run_id))
            pipe.lrange(keys.timeline(run_id), -RECENT_POINTS, -1)
        replies = await pipe.execute()
    snapshots = []
    for i, run_id in enumerate(run_ids):
        meta, stats, pending, ready, leases, lines, points = replies[i * per_run:(i + 1) * per_run]
        meta_text = {text(k) or "": text(v) or "" for k, v in meta.items()}
        if not meta_text or meta_text.get("status") == "deleted":
            continue
        lease_groups = sum(len(_json_list(orjson.loads(raw).get("groups"))) for raw in leases)
        snapshots.append(RunSnapshot(
            run_id=run_id, meta=meta_text, stats={text(k) or "": number(v) for k, v in stats.items()},
            pending=int(pending), ready=int(ready), leased=lease_groups, leased_batches=len(leases), lines=int(lines),
            recent_points=[orjson.loads(p) for p in points]))
    return snapshots
