"""Groups read beyond what a step takes (slime's `--over-sampling-batch-size`), held for the next step.

A held group keeps the batch it was leased in from being acknowledged: a batch is acknowledged only when
none of its groups is held any more, so a trainer that dies with groups held loses nothing (the lease
expires, or its successor's start releases it, and the buffer hands the groups over again, while the
groups already trained are in the checkpoint's metadata and are skipped). A held group's key goes into
the metadata only when it enters the data buffer, so no group is trained twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HeldGroup", "Surplus"]


@dataclass
class HeldGroup:
    """One built, filtered group waiting for a step: its samples, its key, the batch that leased it."""

    samples: list[Any]
    key: str | None
    batch_id: str | None


@dataclass
class Surplus:
    """Held groups in read order, and the leased batches read whose acknowledgement waits on them."""

    groups: deque[HeldGroup] = field(default_factory=deque)
    read_batches: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.groups)

    def hold(self, group: HeldGroup) -> None:
        self.groups.append(group)

    def take(self, count: int) -> list[HeldGroup]:
        """Up to `count` held groups, oldest first."""
        return [self.groups.popleft() for _ in range(min(max(count, 0), len(self.groups)))]

    def take_unkeyed(self) -> list[HeldGroup]:
        """Every held group without a key (from a buffer that names none)."""
        unkeyed = [g for g in self.groups if g.key is None]
        if unkeyed:
            self.groups = deque(g for g in self.groups if g.key is not None)
        return unkeyed

    def held_batches(self) -> set[str]:
        return {g.batch_id for g in self.groups if g.batch_id is not None}

    def note_read(self, batch_id: str) -> None:
        if batch_id not in self.read_batches:
            self.read_batches.append(batch_id)

    def settled(self) -> list[str]:
        """Read batches none of whose groups is held any more (to acknowledge); forgotten here."""
        held = self.held_batches()
        done = [b for b in self.read_batches if b not in held]
        self.read_batches = [b for b in self.read_batches if b in held]
        return done

    def clear(self) -> None:
        """Forget everything (the run was superseded: its leases are gone)."""
        self.groups.clear()
        self.read_batches.clear()
