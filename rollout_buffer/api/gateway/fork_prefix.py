"""What a fork shares with the session's stored turns, so it stores only what it adds.

A client that edits its history is answered from a prompt rendered afresh, but most of that prompt is
usually a stored turn's prompt + output token for token (an edit late in a long history), and most of its
messages are that turn's conversation. The fork keeps a reference (the turn, how many tokens, how many
messages) instead of a copy; reading it back (`session_turns.resolve`, `session_turns.conversation`) gives
exactly the ids and messages a full copy held. Messages are shared only where their JSON bytes are equal, so
the record's messages are the client's own, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from rollout_buffer.store.session_turns import Node, conversation
from rollout_buffer.store.sessions import SessionStore

# below this many shared tokens (and no shared message) a reference costs a chain read for little: copy
MIN_SHARED_TOKENS = 32


@dataclass(frozen=True)
class Shared:
    """A fork's source: turn `turn` (-1: none), its first `tokens` ids and `messages` messages; `chain` is
    what reading the fork back needs (the source and its own chain)."""

    turn: int = -1
    tokens: int = 0
    messages: int = 0
    chain: tuple[int, ...] = ()


def common_tokens(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def common_messages(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    """How many leading messages `a` and `b` share, byte for byte as JSON."""
    n = 0
    for x, y in zip(a, b):
        if x is not y and orjson.dumps(x) != orjson.dumps(y):
            break
        n += 1
    return n


async def shares(store: SessionStore, run_id: str, session_id: str, candidates: list[int], prompt: np.ndarray,
                 messages: list[dict[str, Any]]) -> Shared:
    """The candidate turn a fork with `prompt` and `messages` shares the most tokens with, or none."""
    best = Shared()
    for node in await store.nodes(run_id, session_id, candidates):
        if node is None:
            continue
        tokens = common_tokens(prompt, np.concatenate([node.prompt_ids, node.output_ids]))
        if tokens <= best.tokens and best.turn >= 0:
            continue
        chain = [n for n in await store.nodes(run_id, session_id, node.chain) if n is not None]
        if len(chain) != len(node.chain):
            continue  # an ancestor is gone (never, while the run lives): no reference to what cannot be read
        by_index: dict[int, Node] = {n.index: n for n in chain}
        by_index[node.index] = node
        shared = common_messages(conversation(by_index, node), messages)
        if tokens >= MIN_SHARED_TOKENS or shared:
            best = Shared(node.index, tokens, shared, (*node.chain, node.index))
    return best
