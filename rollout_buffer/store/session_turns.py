"""One stored turn of a gateway session: the engine's exact ids, and what the client sent and got.

Packed as a small JSON header and the id and logprob arrays as raw bytes (int32, float64), so loading a
long prompt is a copy, not a parse of thousands of numbers, and the arrays go to `/generate` and into the
record without a Python object per token. A turn's prompt extends its parent's prompt and output, so only
the new tail is stored (`base` tokens come from the turns of its `chain`): a session costs storage linear in
its tokens, not quadratic; `resolve` puts the full prompts back together. A fork (a client that changed its
history) starts no branch of ids of its own either: it names the turn it shares the most with
(`prefix_turn`), and stores only what follows the first `base` tokens of that turn's prompt + output and the
first `prefix_messages` messages of its conversation (`conversation`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

_HEADER = struct.Struct("<III")  # header bytes, prompt tokens, output tokens


@dataclass
class Node:
    """Turn `index` of a session: its parent turn (-1: a branch root), the messages the client added since
    the parent's answer (the whole history for a root), the answer, and the engine call."""

    index: int
    parent: int
    new_messages: list[dict[str, Any]]
    message: dict[str, Any]
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    finish_reason: str
    weight_version: Any = None
    version_spans: list[list[Any]] | None = None
    history_len: int = 0  # messages in the request (the answer is message number history_len + 1)
    tools: list[dict[str, Any]] | None = None
    fork_reason: str | None = None
    created_at: float = 0.0  # when its answer was ready
    started_at: float = 0.0  # when its request reached the gateway (0: stored before this was kept)
    extra: dict[str, Any] = field(default_factory=dict)
    chain: list[int] = field(default_factory=list)  # ancestors, root first
    base: int = 0  # prompt tokens that are the source's prompt + output (not stored with this turn)
    # a fork's source: the turn whose prompt + output its first `base` tokens are, and whose conversation its
    # first `prefix_messages` messages are (-1: the source is the parent, and a root shares nothing)
    prefix_turn: int = -1
    prefix_messages: int = 0
    resolved: bool = True  # False after `unpack` until `resolve` restored the full prompt
    # what the engine calls' meta_info said, as the runtime keeps it per turn (`Turn.calls`, replay arrays)
    calls: list[dict[str, Any]] | None = None
    routed_experts: np.ndarray | None = None
    routed_experts_start_len: int | None = None
    top_p_token_ids: np.ndarray | None = None
    top_p_token_offsets: np.ndarray | None = None

    def turn(self) -> dict[str, Any]:
        """The record's `turns[]` entry (arrays: the store packs them as they are)."""
        turn: dict[str, Any] = {"prompt_ids": self.prompt_ids, "output_ids": self.output_ids,
                                "output_logprobs": self.output_logprobs, "finish_reason": self.finish_reason,
                                "weight_version": self.weight_version}
        if self.version_spans is not None:
            turn["version_spans"] = self.version_spans
        if self.calls is not None:
            turn["calls"] = self.calls
        if self.routed_experts is not None:
            turn["routed_experts"] = self.routed_experts
            turn["routed_experts_start_len"] = self.routed_experts_start_len or 0
        if self.top_p_token_ids is not None:
            turn["top_p_token_ids"] = self.top_p_token_ids
            turn["top_p_token_offsets"] = self.top_p_token_offsets
        return turn

    def pack(self) -> bytes:
        header = orjson.dumps({
            "index": self.index, "parent": self.parent, "new_messages": self.new_messages, "message": self.message,
            "finish_reason": self.finish_reason, "weight_version": self.weight_version,
            "version_spans": self.version_spans, "history_len": self.history_len, "tools": self.tools,
            "fork_reason": self.fork_reason, "created_at": self.created_at, "started_at": self.started_at,
            "extra": self.extra,
            "chain": self.chain, "base": self.base, "calls": self.calls,
            "routed_experts_start_len": self.routed_experts_start_len,
            "n_experts": None if self.routed_experts is None else len(self.routed_experts),
            "n_top_p": None if self.top_p_token_ids is None else len(self.top_p_token_ids),
            **({"prefix_turn": self.prefix_turn, "prefix_messages": self.prefix_messages}
               if self.prefix_turn >= 0 else {})})
        assert self.resolved, "pack a turn with its full prompt"
        prompt = np.ascontiguousarray(self.prompt_ids[self.base:], dtype="<i4").tobytes()
        output = np.ascontiguousarray(self.output_ids, dtype="<i4").tobytes()
        logprobs = np.ascontiguousarray(self.output_logprobs, dtype="<f8").tobytes()
        replay = [np.ascontiguousarray(values, dtype="<i4").tobytes()
                  for values in (self.routed_experts, self.top_p_token_ids, self.top_p_token_offsets)
                  if values is not None]
        return b"".join((_HEADER.pack(len(header), len(prompt) // 4, len(self.output_ids)), header,
                         prompt, output, logprobs, *replay))

    @classmethod
    def unpack(cls, blob: bytes) -> Node:
        size, n_prompt, n_output = _HEADER.unpack_from(blob)
        at = _HEADER.size
        head = orjson.loads(blob[at:at + size])
        at += size
        prompt = np.frombuffer(blob, dtype="<i4", count=n_prompt, offset=at)
        at += 4 * n_prompt
        output = np.frombuffer(blob, dtype="<i4", count=n_output, offset=at)
        at += 4 * n_output
        logprobs = np.frombuffer(blob, dtype="<f8", count=n_output, offset=at)
        at += 8 * n_output
        n_experts, n_top_p = head.pop("n_experts", None), head.pop("n_top_p", None)
        replay: dict[str, Any] = {}

        def take(count: int) -> np.ndarray:
            nonlocal at
            values = np.frombuffer(blob, dtype="<i4", count=count, offset=at)
            at += 4 * count
            return values

        if n_experts is not None:
            replay["routed_experts"] = take(n_experts)
        if n_top_p is not None:
            replay["top_p_token_ids"] = take(n_top_p)
            replay["top_p_token_offsets"] = take(n_output + 1)
        return cls(prompt_ids=prompt, output_ids=output, output_logprobs=logprobs, resolved=head.get("base", 0) == 0,
                   **replay, **head)

    @property
    def source(self) -> int:
        """The turn this one's first `base` prompt tokens come from."""
        return self.prefix_turn if self.prefix_turn >= 0 else self.parent

    def complete(self, source: Node) -> None:
        """Put the full prompt back: the first `base` tokens of `source`'s (resolved) prompt + output, then
        the stored tail."""
        if len(source.prompt_ids) >= self.base:
            shared = [source.prompt_ids[:self.base]]
        else:
            shared = [source.prompt_ids, source.output_ids[:self.base - len(source.prompt_ids)]]
        self.prompt_ids = np.concatenate([*shared, self.prompt_ids])
        self.resolved = True


def resolve(nodes: dict[int, Node]) -> None:
    """Give every node in `nodes` its full prompt; `nodes` must hold each one's whole chain. A source is
    always an earlier turn, so turns in order find theirs resolved."""
    for node in sorted(nodes.values(), key=lambda n: n.index):
        if not node.resolved:
            node.complete(nodes[node.source])


def conversation(nodes: dict[int, Node], last: Node) -> list[dict[str, Any]]:
    """The full conversation through `last`'s answer: its branch's messages, root first; a fork's root
    begins with the first `prefix_messages` of its source's conversation (`nodes` holds `last`'s chain)."""
    branches: list[list[Node]] = []
    node: Node | None = last
    while node is not None:
        branch = [node]
        while branch[-1].parent >= 0 and branch[-1].parent in nodes:
            branch.append(nodes[branch[-1].parent])
        branches.append(branch)
        root = branch[-1]
        node = nodes[root.prefix_turn] if root.parent < 0 and root.prefix_messages else None
    messages: list[dict[str, Any]] = []
    for branch in reversed(branches):  # the oldest source first: each root cuts what came before it
        messages = messages[:branch[-1].prefix_messages]
        for step in reversed(branch):
            messages.extend(step.new_messages)
            messages.append(step.message)
    return messages
