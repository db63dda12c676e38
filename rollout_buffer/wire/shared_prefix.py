"""A stored record whose turns share prompt prefixes beyond `ext`: one copy of a shared prefix, not one per turn.

The packed form (`packing`, `RB1`) stores a turn's prompt as a tail only when it extends the turn just before
it. A gateway session whose client edits its history has turns that start over from an earlier turn (forks,
rewinds): in `RB1` each of them holds its whole prompt again, so 200 edits of a long conversation hold 200
copies of it. What Redis keeps of such a record is `RB2`:

    b"RB2", u32 n, the RB1 header (n bytes, exactly as `pack_record` wrote it),
    u32 m, the shares (m bytes of JSON: `[[turn, source, tokens], ...]`, turns ascending),
    the RB1 arrays, except that each listed turn's prompt lacks its first `tokens` ids

where a share says: turn `turn`'s prompt begins with the first `tokens` ids of turn `source`'s prompt + output
(`source < turn`). `expand` gives back the RB1 blob byte for byte, so every reader (the JSON and packed reads,
and through them the trainer, the CLI and the dashboard) sees what it saw when the whole prompts were stored,
and a record stored before (`RB1`) is read as it always was. `RB2` never leaves the server.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from rollout_buffer.wire.packing import MAGIC, PackingError, pack_record, read_header, replay_size

SHARED_MAGIC = b"RB2"
_LEN = struct.Struct("<I")
MIN_SHARED_TOKENS = 16  # a share's few bytes of JSON are worth it from here on


def _take(pieces: list[memoryview], size: int) -> list[memoryview]:
    """The first `size` bytes of the concatenation of `pieces`, as views."""
    taken: list[memoryview] = []
    for piece in pieces:
        if size <= 0:
            break
        taken.append(piece[:size])
        size -= len(taken[-1])
    if size > 0:
        raise PackingError("a shared prefix is longer than its source turn's prompt and output")
    return taken


def _turn_end(meta: dict[str, Any], at: int, prompt_ids: int) -> tuple[int, int]:
    """Where a turn's prompt ids end and where the turn ends, its prompt holding `prompt_ids` ids from `at`."""
    try:
        outputs, width = int(meta["o"]), int(meta["lp"])
        return at + 4 * prompt_ids, at + 4 * (prompt_ids + outputs) + width * outputs + replay_size(meta, outputs)
    except (KeyError, TypeError, ValueError) as exc:
        raise PackingError(f"bad turn metadata ({exc})") from exc


def pack_shared(record: dict[str, Any], sources: Sequence[int | None]) -> bytes:
    """What Redis keeps of `record`: `pack_record`'s RB1 blob, or RB2 when a turn's prompt begins with at least
    `MIN_SHARED_TOKENS` ids of the prompt + output of the earlier turn `sources[i]` names (a hint; the shared
    length is measured here, so a wrong hint only costs the comparison). A turn that extends the one before it
    is already stored as its tail (`ext`) and takes no share."""
    blob = pack_record(record)
    header, arrays_at = read_header(blob)
    metas = header.get("_turns") or []
    wanted = {i: s for i, s in enumerate(sources[:len(metas)]) if s is not None and 0 <= s < i
              and not metas[i]["ext"]}
    if not wanted:
        return blob
    keep = set(wanted.values())
    view = memoryview(blob)
    histories: dict[int, list[memoryview]] = {}
    history: list[memoryview] = []
    shares: list[list[int]] = []
    arrays: list[memoryview] = []
    at = arrays_at
    for i, meta in enumerate(metas):
        prompt_end, end = _turn_end(meta, at, int(meta["p"]))
        prompt = view[at:prompt_end]
        cut = 0
        if i in wanted:
            pieces = histories[wanted[i]]
            source = b"".join(_take(pieces, min(len(prompt), sum(len(piece) for piece in pieces))))
            cut = _common(prompt, memoryview(source))
            if cut >= MIN_SHARED_TOKENS:
                shares.append([i, wanted[i], cut])
            else:
                cut = 0
        arrays += [prompt[4 * cut:], view[prompt_end:end]]
        if not meta["ext"]:
            history = []
        history += [prompt, view[prompt_end:prompt_end + 4 * int(meta["o"])]]
        if i in keep:
            histories[i] = list(history)
        at = end
    if not shares:
        return blob
    table = orjson.dumps(shares)
    head = view[len(MAGIC) + _LEN.size:arrays_at]
    return b"".join([SHARED_MAGIC, _LEN.pack(len(head)), head, _LEN.pack(len(table)), table, *arrays])


def _common(prompt: memoryview, source: memoryview) -> int:
    """How many leading int32 ids two little-endian id arrays share."""
    n = min(len(prompt), len(source)) // 4
    a = np.frombuffer(prompt[:4 * n], dtype="<i4")
    b = np.frombuffer(source[:4 * n], dtype="<i4")
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if differ.size else n


def _shares(raw: bytes | memoryview, turns: int) -> dict[int, tuple[int, int]]:
    """The share table, checked: each turn once, an earlier source, a positive length."""
    try:
        table = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise PackingError(f"shared record: the share table is not JSON ({exc})") from exc
    found: dict[int, tuple[int, int]] = {}
    for entry in table if isinstance(table, list) else [None]:
        if (not isinstance(entry, list) or len(entry) != 3 or any(type(x) is not int for x in entry)
                or not 0 <= entry[1] < entry[0] < turns or entry[2] <= 0 or entry[0] in found):
            raise PackingError(f"shared record: bad share {entry!r}")
        found[entry[0]] = (entry[1], entry[2])
    return found


def expand(blob: bytes) -> bytes:
    """The RB1 blob of a stored record: an RB2 blob with every shared prefix put back (byte for byte what
    `pack_record` wrote), anything else as it is. Raises PackingError when an RB2 blob does not add up."""
    if blob[:len(SHARED_MAGIC)] != SHARED_MAGIC:
        return blob
    view = memoryview(blob)
    at = len(SHARED_MAGIC)
    if at + _LEN.size > len(blob):
        raise PackingError("shared record: truncated")
    (head_len,) = _LEN.unpack_from(blob, at)
    head = view[at + _LEN.size:at + _LEN.size + head_len]
    at += _LEN.size + head_len
    if at + _LEN.size > len(blob):
        raise PackingError("shared record: truncated after its header")
    (table_len,) = _LEN.unpack_from(blob, at)
    table_at = at + _LEN.size
    at = table_at + table_len
    header, _ = read_header(b"".join([MAGIC, _LEN.pack(head_len), head]))
    metas = header.get("_turns")
    if not isinstance(metas, list):
        raise PackingError("shared record without turns")
    shares = _shares(view[table_at:at], len(metas))
    needed: dict[int, int] = {}
    for source, tokens in shares.values():
        needed[source] = max(needed.get(source, 0), tokens)
    saved: dict[int, list[memoryview]] = {}
    history: list[memoryview] = []
    out: list[bytes | memoryview] = [MAGIC, _LEN.pack(head_len), head]
    for i, meta in enumerate(metas):
        source, tokens = shares.get(i, (-1, 0))
        prompt_ids = meta.get("p") if isinstance(meta, dict) else None
        if type(prompt_ids) is not int or (tokens and (meta.get("ext") or tokens > prompt_ids)):
            raise PackingError(f"shared record: turn {i} cannot take a share of {tokens} ids")
        prefix = _take(saved[source], 4 * tokens) if tokens else []
        prompt_end, end = _turn_end(meta, at, prompt_ids - tokens)
        if end > len(blob):
            raise PackingError(f"shared record: turn {i} runs past the end")
        tail = view[at:prompt_end]
        out += [*prefix, tail, view[prompt_end:end]]
        if not meta.get("ext"):
            history = []
        history += [*prefix, tail, view[prompt_end:prompt_end + 4 * int(meta["o"])]]
        if i in needed:
            saved[i] = _take(history, 4 * needed[i])
        at = end
    if at != len(blob):
        raise PackingError(f"shared record has {len(blob) - at} trailing bytes")
    return b"".join(out)
