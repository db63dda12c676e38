"""Staleness and group generations in the Redis scripts, on a real Redis: group versions, stale groups
dropped / requeued / kept at hand-over, older generations refused, the admission rule where tasks start,
the prompt stream extended past the plan, and every new key listed in `run_keys`."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from redis.asyncio.cluster import RedisCluster

from rollout_buffer.runtime.jobqueue import Job, JobQueue
from rollout_buffer.store import handover, keys
from rollout_buffer.store.store import Store
from tests.support.helpers import make_record


async def new_run(store: Store, *, group_size: int = 2, num_epoch: int = 1, **meta: Any) -> str:
    run_id = f"s-{uuid.uuid4().hex[:8]}"
    await store.create_run(run_id, {"run_id": run_id}, group_size=group_size, num_epoch=num_epoch,
                           task_type="external", extra_meta={"stale_policy": "requeue", "plan_seq": 0, **meta})
    return run_id


async def write_group(store: Store, run_id: str, iid: str, versions: list[int | None], *, epoch: int = 0,
                      rewards: list[float] | None = None, generation: int | None = None) -> list[str]:
    outcomes = []
    for k, version in enumerate(versions):
        record = make_record(iid, epoch=epoch, reward=(rewards or [1.0] * len(versions))[k],
                             policy_version=version, generation=generation)
        outcomes.append((await store.write_record(run_id, record)).outcome)
    return outcomes


async def stats(store: Store, run_id: str) -> dict[str, float]:
    return await store.stats(run_id)


async def test_a_group_keeps_its_oldest_version_and_a_stale_one_is_dropped(redis_store: Store) -> None:
    run_id = await new_run(redis_store, max_staleness=1, stale_policy="drop")
    await write_group(redis_store, run_id, "old", [5, 3])
    await write_group(redis_store, run_id, "new", [4, 5])
    assert await redis_store.redis.hget(keys.group_version(run_id), "0:old") == b"3", "the oldest member's version"
    batch = await handover.read_ready(redis_store, run_id, policy_version=5)
    assert batch.policy_version == 5
    assert [g.gid for g in batch.groups] == ["0:new"], "staleness 2 > 1: not handed over"
    assert batch.dropped == ["0:old"] and batch.requeued == []
    counters = await stats(redis_store, run_id)
    assert counters["stale_dropped_groups"] == 1 and counters["stale_dropped_samples"] == 2
    assert counters["groups_consumed"] == 2, "the dropped group and the handed one both left the buffer"
    assert await redis_store.redis.hget(keys.group_version(run_id), "0:old") is None, "dropped with its data"
    assert (await redis_store.run_meta(run_id))["policy_version"] == "5", "the reader's version is the run's"


async def test_without_a_reader_version_nothing_is_stale(redis_store: Store) -> None:
    run_id = await new_run(redis_store, max_staleness=0, stale_policy="drop")
    await write_group(redis_store, run_id, "a", [0, 0])
    batch = await handover.read_ready(redis_store, run_id)
    assert [g.gid for g in batch.groups] == ["0:a"] and batch.policy_version is None


async def test_keep_hands_stale_groups_over(redis_store: Store) -> None:
    run_id = await new_run(redis_store, max_staleness=0, stale_policy="keep")
    await write_group(redis_store, run_id, "a", [1, 2])
    batch = await handover.read_ready(redis_store, run_id, policy_version=9)
    assert [g.gid for g in batch.groups] == ["0:a"] and not batch.dropped and not batch.requeued


async def test_a_stale_group_is_requeued_as_its_next_generation(redis_store: Store) -> None:
    run_id = await new_run(redis_store, max_staleness=0)
    queue = JobQueue(redis_store.redis, run_id)
    await queue.enqueue([{"instance_id": "a"}], num_epoch=1, repeats=2, excluded=set())
    await redis_store.redis.hset(keys.run_meta(run_id), "status", "finished")  # as if its tasks were all done
    assert await write_group(redis_store, run_id, "a", [0, 0], generation=0) == ["stored", "completed"]
    batch = await handover.read_ready(redis_store, run_id, 2, lease_s=30, batch_id="b1", policy_version=1)
    assert batch.kind == "empty" and batch.requeued == ["0:a"]
    meta = await redis_store.run_meta(run_id)
    assert meta["status"] == "running", "new tasks reopen a finished run"
    entries = await redis_store.redis.xrange(queue.stream)
    assert [e[0] for e in entries] == [b"0-1", b"0-2", b"0-3", b"0-4"], "appended at the next ids"
    assert [e[1].get(b"g") for e in entries] == [None, None, b"1", b"1"]
    assert meta["tasks_total"] == "4"
    counters = await stats(redis_store, run_id)
    assert counters["stale_requeued_groups"] == 1 and counters["tasks_queued"] == 4
    assert counters["groups_consumed"] == 1
    # a late write of the old generation is refused; the new generation fills the group again
    assert await write_group(redis_store, run_id, "a", [1], generation=0) == ["dropped"]
    assert (await stats(redis_store, run_id))["drop:stale_generation"] == 1
    assert await write_group(redis_store, run_id, "a", [1, 1], generation=1) == ["stored", "completed"]
    fresh = await handover.read_ready(redis_store, run_id, policy_version=1)
    assert [g.gid for g in fresh.groups] == ["0:a"] and all(r["generation"] == 1 for r in fresh.groups[0].records)
    first, again = Job("0-1", 0, "a", 0, 0), Job("0-3", 0, "a", 0, 1)
    assert (first.uid(run_id), again.uid(run_id)) == (f"{run_id}:0:a:0", f"{run_id}:0:a:0@1"), "fresh uids"


async def test_admission_defers_new_groups_beyond_the_bound(redis_store: Store) -> None:
    run_id = await new_run(redis_store, max_staleness=0, groups_per_read_hint=1)
    queue = JobQueue(redis_store.redis, run_id)
    await queue.enqueue([{"instance_id": "a"}, {"instance_id": "b"}], num_epoch=1, repeats=2, excluded=set())
    tasks = await queue.read_new("c1", 10, 100)
    assert [(t.instance_id, t.repeat) for t in tasks] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert (await queue.start(tasks[0])).proceed, "the first group starts"
    held = await queue.start(tasks[2])
    assert held.deferred and not held.proceed, "(0 + 1) x 1 group may be started and unconsumed"
    assert (await queue.start(tasks[1])).proceed, "a started group's other tasks always start"
    assert (await stats(redis_store, run_id))["groups_started"] == 1
    await write_group(redis_store, run_id, "a", [0, 0])
    assert (await queue.start(tasks[2])).deferred, "completed but not consumed yet"
    await handover.read_ready(redis_store, run_id, 2, asked_groups=1)
    assert (await queue.start(tasks[2])).proceed, "consumed: room for the next group"
    assert (await redis_store.run_meta(run_id))["groups_per_read"] == "1"


async def test_admission_follows_the_groups_per_read(redis_store: Store) -> None:
    run_id = await new_run(redis_store, group_size=1, max_staleness=1, groups_per_read_hint=1)
    queue = JobQueue(redis_store.redis, run_id)
    await queue.enqueue([{"instance_id": f"i{n}"} for n in range(6)], num_epoch=1, repeats=1, excluded=set())
    tasks = await queue.read_new("c1", 10, 100)
    started = [(await queue.start(t)).proceed for t in tasks]
    assert started == [True, True, False, False, False, False], "(1 + 1) x 1 before any read"
    await handover.read_ready(redis_store, run_id, 2, asked_groups=2)  # a reader asking for 2 groups
    started = [(await queue.start(t)).proceed for t in tasks[2:]]
    assert started == [True, True, False, False], "(1 + 1) x 2 once a read asked for 2"


async def test_the_prompt_stream_goes_on_past_the_plan(redis_store: Store) -> None:
    run_id = await new_run(redis_store, group_filter="nonzero_std")
    queue = JobQueue(redis_store.redis, run_id)
    await queue.enqueue([{"instance_id": "a"}, {"instance_id": "b"}], num_epoch=1, repeats=2, excluded=set(),
                        keep_order=True)
    meta = await redis_store.run_meta(run_id)
    assert meta["num_lines"] == "2" and meta["extra_groups_cap"] == "2"
    await redis_store.add_skip_groups(run_id, ["1:a"])
    assert await handover.extend_stream(redis_store, run_id, 1) == 1
    entries = await redis_store.redis.xrange(queue.stream)
    assert [(e[1][b"e"], e[1][b"i"]) for e in entries[4:]] == [(b"1", b"b")] * 2, "next epoch, trained groups passed"
    assert await write_group(redis_store, run_id, "b", [None, None], epoch=1) == ["stored", "completed"]
    assert await write_group(redis_store, run_id, "a", [None], epoch=2) == ["dropped"], "past the added epochs"
    assert await handover.extend_stream(redis_store, run_id, 5) == 1, "capped at max_extra_groups (plan size)"
    meta = await redis_store.run_meta(run_id)
    assert (meta["extra_groups"], meta["epoch_limit"]) == ("2", "3")
    assert (await stats(redis_store, run_id))["groups_extended"] == 2


async def test_an_acknowledged_lease_applies_its_counts_and_replacements(redis_store: Store) -> None:
    run_id = await new_run(redis_store)
    queue = JobQueue(redis_store.redis, run_id)
    await queue.enqueue([{"instance_id": "a"}], num_epoch=1, repeats=2, excluded=set(), keep_order=True)
    await write_group(redis_store, run_id, "a", [2, 2])
    await handover.read_ready(redis_store, run_id, lease_s=30, batch_id="b1", policy_version=3)
    await handover.set_lease_outcome(redis_store, run_id, "b1", filtered=0, hook_errors=0,
                                     counts={"drop:zero_std": 1, "staleness_hist:1": 2}, extend=1)
    counters = await stats(redis_store, run_id)
    assert "drop:zero_std" not in counters, "counted at the acknowledgement, not at the read"
    outcome = await handover.ack_batch(redis_store, run_id, "b1")
    assert (outcome.outcome, outcome.groups, outcome.added_groups) == ("acked", 1, 1)
    counters = await stats(redis_store, run_id)
    assert counters["drop:zero_std"] == 1 and counters["staleness_hist:1"] == 2 and counters["groups_consumed"] == 1
    assert await redis_store.redis.xlen(queue.stream) == 4


async def test_every_key_a_staleness_run_touches_is_a_run_key(redis_store: Store) -> None:
    run_id = await new_run(redis_store, max_staleness=0, group_filter="nonzero_std")
    queue = JobQueue(redis_store.redis, run_id)
    await queue.enqueue([{"instance_id": "a"}], num_epoch=1, repeats=2, excluded=set(), keep_order=True)
    for task in await queue.read_new("c", 10, 100):
        await queue.start(task)
    await write_group(redis_store, run_id, "a", [0, 0])
    await handover.read_ready(redis_store, run_id, policy_version=1)  # requeued
    await write_group(redis_store, run_id, "a", [1, 1], generation=1)
    await handover.extend_stream(redis_store, run_id, 1)
    pattern, client = f"*{{{run_id}}}*", redis_store.redis
    if isinstance(client, RedisCluster):  # every key of a run is in one slot: ask the node that holds it
        found = await client.keys(pattern, target_nodes=client.get_node_from_key(keys.run_meta(run_id)))
    else:
        found = await client.keys(pattern)
    present = {k.decode() for k in found}
    assert {keys.group_generation(run_id), keys.group_version(run_id), keys.group_started(run_id),
            keys.lines(run_id)} <= present
    assert present <= set(keys.run_keys(run_id))
    raw = await redis_store.redis.hgetall(keys.group_started(run_id))
    assert raw == {b"0:a": b"0"}, orjson.dumps({k.decode(): v.decode() for k, v in raw.items()})


async def test_the_current_versions_batch_counts_as_unconsumed(redis_store: Store) -> None:
    run_id = await new_run(redis_store, group_size=1, max_staleness=0, groups_per_read_hint=1, policy_version=0,
                           consumed_before_version=0)
    queue = JobQueue(redis_store.redis, run_id)
    await queue.enqueue([{"instance_id": "a"}, {"instance_id": "b"}], num_epoch=1, repeats=1, excluded=set())
    a, b = await queue.read_new("c1", 10, 100)
    assert (await queue.start(a)).proceed and (await queue.start(b)).deferred
    await write_group(redis_store, run_id, "a", [0])
    await handover.read_ready(redis_store, run_id, 1, policy_version=0)
    assert (await queue.start(b)).deferred, "consumed at version 0, which the trainer is still training on"
    await handover.read_ready(redis_store, run_id, 1, policy_version=1)
    assert (await redis_store.run_meta(run_id))["consumed_before_version"] == "1"
    assert (await queue.start(b)).proceed, "version 1: the batch of version 0 is done"


async def test_a_group_is_requeued_at_most_max_requeues_times(redis_store: Store) -> None:
    run_id = await new_run(redis_store, max_staleness=0, max_requeues=1)
    queue = JobQueue(redis_store.redis, run_id)
    await queue.enqueue([{"instance_id": "a"}], num_epoch=1, repeats=2, excluded=set())
    await write_group(redis_store, run_id, "a", [0, 0], generation=0)
    assert (await handover.read_ready(redis_store, run_id, policy_version=2)).requeued == ["0:a"]
    await write_group(redis_store, run_id, "a", [1, 1], generation=1)
    again = await handover.read_ready(redis_store, run_id, policy_version=3)
    assert again.requeued == [] and again.dropped == ["0:a"], "requeued once already: dropped"
    counters = await stats(redis_store, run_id)
    assert counters["drop:stale_requeue_limit"] == 1 and counters["stale_dropped_groups"] == 1


async def test_a_filter_this_process_cannot_load_hands_groups_over_counted(redis_store: Store) -> None:
    from rollout_buffer.runs.reads import read_rollout_data

    run_id = await new_run(redis_store, group_filter="no_such_module_anywhere.f")
    await write_group(redis_store, run_id, "a", [None, None])
    answer = await read_rollout_data(redis_store, run_id, None, num=None, wait_s=0, min_valid_group_size=1,
                                     run_meta=await redis_store.run_meta(run_id))
    assert [r["instance_id"] for r in answer["data"]["data"]] == ["a", "a"], "unfiltered, not lost"
    assert (await stats(redis_store, run_id))["group_filter_unavailable"] == 1


async def test_filtered_and_stale_groups_free_admission_at_once(redis_store: Store) -> None:
    run_id = await new_run(redis_store, group_size=1, max_staleness=0, groups_per_read_hint=1, policy_version=0,
                           consumed_before_version=0)
    queue = JobQueue(redis_store.redis, run_id)
    await queue.enqueue([{"instance_id": "a"}, {"instance_id": "b"}, {"instance_id": "c"}], num_epoch=1, repeats=1,
                        excluded=set())
    a, b, c = await queue.read_new("c1", 10, 100)
    assert (await queue.start(a)).proceed and (await queue.start(b)).deferred
    await write_group(redis_store, run_id, "a", [0])
    await handover.read_ready(redis_store, run_id, 1, lease_s=30, batch_id="f", policy_version=0)
    await handover.set_lease_outcome(redis_store, run_id, "f", filtered=0, hook_errors=0, extend=1)
    await handover.ack_batch(redis_store, run_id, "f")
    assert (await queue.start(b)).proceed, "a filtered group is no part of the batch being trained: room at once"
    await write_group(redis_store, run_id, "b", [0])
    await redis_store.set_policy_version(run_id, 2)
    assert (await handover.read_ready(redis_store, run_id, 1)).requeued == ["0:b"]
    assert (await queue.start(c)).proceed, "the stale group left the room it held"
    [again] = await queue.read_new("c1", 10, 100)
    assert (again.instance_id, again.gen) == ("b", 1) and (await queue.start(again)).deferred, "bounded as any group"
