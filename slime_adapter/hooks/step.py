"""One trainer step's intake: the groups of each read built into Samples, run through slime's dynamic
filter, held (over-sampling) or handed to slime's data buffer, and what was consumed recorded in its
metadata for resume (see `slime_adapter.hooks.agent_rollout`, which drives the reads)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_adapter.hooks.dynamic_filter import DropCounts, judge, load_filter, should_drop
from slime_adapter.hooks.surplus import HeldGroup
from slime_adapter.samples.build import BuildStats, build_group_samples
from slime_adapter.samples.tokenizers import get_tokenizer
from slime_adapter.settings import AgentRolloutSettings

__all__ = ["SampleBuildError", "Step", "group_keys", "split_groups"]

log = logging.getLogger("slime_adapter.hooks.agent_rollout")


class SampleBuildError(RuntimeError):
    """A handed-over group could not be turned into exact samples; `records` keeps it for inspection."""

    def __init__(self, message: str, records: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.records = records



def split_groups(records: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Records of one read, grouped by (instance_id, epoch), in the order the buffer handed them over."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((str(record["instance_id"]), record.get("epoch")), []).append(record)
    return list(groups.values())


def group_keys(groups: list[list[dict[str, Any]]], meta: dict[str, Any]) -> list[str | None]:
    """Each group's key ("<epoch>:<instance_id>") from the read's `finished_groups` / `finished_group_keys`
    (in hand-over order), matched by instance id and, when the records say it, epoch."""
    pairs = list(zip((str(i) for i in meta.get("finished_groups") or []),
                     (str(k) for k in meta.get("finished_group_keys") or [])))
    used: set[int] = set()
    keys: list[str | None] = []
    for group in groups:
        instance_id, epoch = str(group[0]["instance_id"]), group[0].get("epoch")
        found = next((i for i, (iid, key) in enumerate(pairs) if i not in used and iid == instance_id
                      and (epoch is None or key.startswith(f"{epoch}:"))), None)
        if found is not None:
            used.add(found)
        keys.append(pairs[found][1] if found is not None else None)
    return keys



@dataclass
class Step:
    """One trainer step's fetch: reads' meta_info, finished ids, build counts."""

    settings: AgentRolloutSettings
    state: Any  # slime_adapter.hooks.agent_rollout.AgentRolloutState
    data_buffer: Any
    rollout_id: int
    args: Any = None
    need: int = 0  # groups this step puts into the data buffer
    metas: list[dict[str, Any]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # group keys "<epoch>:<instance_id>"
    finished_ids: list[str] = field(default_factory=list)  # from a buffer that names no keys (slime's own)
    stats: BuildStats = field(default_factory=BuildStats)
    groups_added: int = 0
    size_mismatches: int = 0
    drops: DropCounts = field(default_factory=DropCounts)
    dynamic_filter: Any = None
    # batches of earlier steps, which the trainer has trained: this step's reads acknowledge them; a batch
    # this step takes in waits for the next step (a trainer killed before then gets it back, not lost),
    # unless the buffer filtered some of its groups (their replacements come with the ack)
    ackable: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.ackable = set(self.state.pending_acks)
        self.dynamic_filter = load_filter(self.settings.dynamic_filter_path)
        earlier = (self.data_buffer.get_metadata() or {}).get(self._key)
        if isinstance(earlier, dict):  # this step was interrupted and is being retried: keep what it consumed
            self.finished = [str(k) for k in earlier.get("groups") or []]
            self.finished_ids = [str(i) for i in earlier.get("instance_ids") or []]

    @property
    def _key(self) -> str:
        return str(self.rollout_id)

    def _tokenizer(self) -> Any:
        if not self.settings.hf_checkpoint:
            raise ValueError("a record without `turns` needs a tokenizer to re-render its messages; "
                             "set args.hf_checkpoint")
        return get_tokenizer(self.settings.hf_checkpoint, trust_remote_code=True)

    def _build(self, records: list[dict[str, Any]]) -> list[Any]:
        group_index = self.state.next_group_index
        samples, stats = build_group_samples(records, self._tokenizer, self.settings.loss_mask_type,
                                             group_index=group_index, fork_policy=self.settings.fork_policy,
                                             verify=self.settings.loss_mask_verify,
                                             mask_offpolicy=self.settings.mask_offpolicy,
                                             first_rollout_id=self.state.next_rollout_id,
                                             moe_shape=self.settings.moe_shape)
        self.state.next_rollout_id += len(records)
        if self.settings.partial_rollout:  # slime marks samples continued across a weight update
            for sample in samples:
                seen = sample.metadata.get("policy_versions_seen") or []
                if len(seen) > 1:
                    sample.metadata.setdefault("start_rollout_id", min(seen))
        has_raw = {r["uid"]: r.get("raw_reward") is not None for r in records}
        for sample in samples:
            if self.settings.reward_field(has_raw[sample.metadata["uid"]]) == "raw_reward":
                sample.reward = sample.metadata["raw_reward"]
        self.state.next_group_index += 1
        self.stats.merge(stats)
        if len(samples) != self.settings.n_samples_per_prompt:
            self.size_mismatches += 1
            log.warning("group of instance %s has %d sample(s), n_samples_per_prompt is %d (forks: %d, "
                        "agent_fork_policy %r); slime's group reward normalisation and "
                        "RolloutDataSourceWithBuffer.add_samples assume groups of exactly n_samples_per_prompt",
                        records[0]["instance_id"], len(samples), self.settings.n_samples_per_prompt, stats.forks,
                        self.settings.fork_policy)
        return samples

    def accept(self, records: list[dict[str, Any]], meta: dict[str, Any], batch_id: str | None = None) -> int:
        """Build one read's groups, run slime's dynamic filter on each, hold the kept ones and hand over
        what the step still needs (`hand_over`); returns how many groups went into the data buffer.

        A group's key is in the metadata once it is in the data buffer or dropped (filtered by the buffer
        or the dynamic filter, or failing to build): the checkpoint then says it was consumed. A group held
        for the next step is not, and keeps its batch unacknowledged (`slime_adapter.hooks.surplus`).
        """
        if meta:
            self.metas.append(meta)
        groups = split_groups(records)
        first_new = len(self.finished)
        keyed = "finished_group_keys" in meta
        keys = group_keys(groups, meta) if keyed else [None] * len(groups)
        if keyed:  # groups the buffer filtered: consumed now
            in_data = set(keys)
            self.finished.extend(str(k) for k in meta["finished_group_keys"] if str(k) not in in_data)
        else:  # slime's form: one instance id per group (see buffer_client.resume_keys_from_metadata)
            self.finished_ids.extend(str(i) for i in meta.get("finished_groups") or [])
        before = self.groups_added
        try:
            for index, (group, key) in enumerate(zip(groups, keys)):
                try:
                    samples = self._build(group)
                except Exception as exc:
                    self.finished.extend(k for k in keys[index:] if k is not None)  # consumed, as before
                    raise SampleBuildError(f"cannot build samples for the group of instance "
                                           f"{group[0]['instance_id']}: {type(exc).__name__}: {exc}", group) from exc
                verdict = judge(self.dynamic_filter, self.args, samples)
                candidates = self.groups_added + len(self.state.surplus) + len(groups) - index
                if should_drop(verdict, candidates=candidates, target=self.need):
                    self.drops.note(verdict.reason)
                    if key is not None:
                        self.finished.append(key)
                    continue
                self.state.surplus.hold(HeldGroup(samples, key, batch_id if keyed else None))
        finally:
            order = {str(k): i for i, k in enumerate(meta.get("finished_group_keys") or [])}
            self.hand_over(order=order, since=first_new)
        return self.groups_added - before

    def hand_over(self, record_always: bool = True, order: dict[str, int] | None = None, since: int = 0) -> None:
        """Move held groups into the data buffer up to the step's need; record what was consumed (after a
        read always, else only when a group was taken). Keys recorded from `since` on are put in the
        read's hand-over `order` (groups held from earlier reads first)."""
        taken = self.state.surplus.take(self.need - self.groups_added)
        # a buffer that names no keys (slime's own) counted its groups consumed when it handed them over:
        # its surplus waits in slime's data buffer, as slime's own client leaves it
        taken += self.state.surplus.take_unkeyed()
        if not taken and not record_always:
            return
        self.finished.extend(g.key for g in taken if g.key is not None)
        if order:
            self.finished[since:] = sorted(self.finished[since:], key=lambda k: order.get(k, -1))
        record: dict[str, list[str]] = {"groups": list(self.finished)}
        if self.finished_ids:
            record["instance_ids"] = list(self.finished_ids)
        self.data_buffer.update_metadata({self._key: record})
        if taken:
            self.data_buffer.add_samples([g.samples for g in taken])
            self.groups_added += len(taken)
        self.state.pending_acks.extend(b for b in self.state.surplus.settled() if b not in self.state.pending_acks)
