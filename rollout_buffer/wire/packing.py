"""Stored form of a trajectory record: a JSON header plus packed token arrays.

Layout: `b"RB1"`, a little-endian u32 header length, the orjson header (the record without `turns`, plus
`_turns`: one small dict per turn), then the turns' arrays back to back, little-endian. Token ids are
int32. Logprobs are float32 when every value survives the float32 round trip exactly (engines compute
them in float32), float64 otherwise, so what comes back is always bit-identical to what was written. A
turn whose prompt extends the previous turn's prompt + output stores only the new tail (`ext`), the
usual multi-turn case, so a 4-turn trajectory does not store its prompt four times.

Turns may be given as dicts or as objects with the same attributes (the validated wire models), so the
API packs what it parsed without copying it into dicts first.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any

import numpy as np
import orjson

from rollout_buffer.wire.schema import TOKEN_ID_MAX

MAGIC = b"RB1"
_HEADER_LEN = struct.Struct("<I")
_SWAP = sys.byteorder != "little"
_TURN_FIELDS = ("prompt_ids", "output_ids", "output_logprobs", "finish_reason", "weight_version", "version_spans",
                "calls", "routed_experts", "routed_experts_start_len", "top_p_token_ids", "top_p_token_offsets")


_META_KEYS = frozenset({"ext", "p", "o", "lp", "finish_reason", "weight_version"})
# Optional per-turn keys: version spans, the engine calls' meta, and the replay arrays' sizes (`re` routed
# expert ids from row `rs`; `tp` top-p ids, followed by `o + 1` offsets). Arrays follow the logprobs.
_OPTIONAL_META_KEYS = frozenset({"vs", "calls", "re", "rs", "tp"})


class PackingError(ValueError):
    pass


def _from_le(kind: str, data: memoryview | bytes) -> list[Any]:
    values = array(kind)
    values.frombytes(data)
    if _SWAP:
        values.byteswap()
    return values.tolist()


def _turn_values(turn: Any) -> tuple[Any, ...]:
    if isinstance(turn, dict):
        return tuple(turn.get(name) for name in _TURN_FIELDS)
    return tuple(getattr(turn, name, None) for name in _TURN_FIELDS)


def token_array(values: Any) -> np.ndarray:
    """Token ids as a little-endian int32 array: from a list, or from any integer array without a Python
    object per id. Ids must lie in [0, 2^31)."""
    ids = values if isinstance(values, np.ndarray) else np.asarray(values if len(values) else [], dtype=np.int64)
    if ids.dtype.kind not in "iu":
        raise PackingError(f"token ids must be integers, got {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > TOKEN_ID_MAX):
        raise PackingError("token id out of int32 range [0, 2^31)")
    return ids.astype("<i4", copy=False)


def pack_record(record: dict[str, Any]) -> bytes:
    """Serialize a validated record (`turns` as dicts or turn objects; id and logprob sequences as lists
    or numpy arrays) to bytes."""
    turns = record.get("turns")
    header = {k: v for k, v in record.items() if k != "turns"}
    chunks: list[bytes] = []
    if turns is not None:
        turn_meta: list[dict[str, Any]] = []
        previous: tuple[Any, Any] | None = None  # the last turn's prompt and output ids, as given
        for turn in turns:
            (prompt_values, output_values, logprobs, finish_reason, weight_version, spans, calls, experts,
             experts_start, top_p_ids, top_p_offsets) = _turn_values(turn)
            try:
                stored_prompt, output, extends = _turn_ids(turn, prompt_values, output_values, previous)
            except OverflowError as exc:
                raise PackingError(f"token id out of int32 range: {exc}") from exc
            previous = (prompt_values, output_values)
            meta: dict[str, Any] = {"ext": extends, "p": len(stored_prompt), "o": len(output),
                                    "finish_reason": finish_reason, "weight_version": weight_version}
            if spans is not None:
                meta["vs"] = [list(span) for span in spans]
            chunks.append(stored_prompt.tobytes())
            chunks.append(output.tobytes())
            if logprobs is None:
                meta["lp"] = 0
            else:
                wide = np.asarray(logprobs, dtype="<f8")
                with np.errstate(over="ignore"):  # a value beyond float32's range is simply kept as float64
                    narrow = wide.astype("<f4")
                exact = np.array_equal(narrow, wide)  # every value is a float32 value (engines' case)
                meta["lp"] = 4 if exact else 8
                chunks.append((narrow if exact else wide).tobytes())
            if calls is not None:
                meta["calls"] = [dict(call) for call in calls]
            chunks.extend(_pack_replay(meta, experts, experts_start, top_p_ids, top_p_offsets, len(output)))
            turn_meta.append(meta)
        header["_turns"] = turn_meta
    head = orjson.dumps(header)
    return b"".join([MAGIC, _HEADER_LEN.pack(len(head)), head, *chunks])


def _turn_ids(turn: Any, prompt_values: Any, output_values: Any,
              previous: tuple[Any, Any] | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """A turn's prompt ids to store, its output ids, and whether the prompt extends the last turn's (then
    only the new tail is stored)."""
    checked = getattr(turn, "ids_checked", False)  # int32 arrays the parser range-checked already
    output = output_values if checked else token_array(output_values)
    if previous is not None and type(prompt_values) is type(previous[0]) is type(previous[1]) is list:
        # as lists: a C comparison (often of the very same objects), and only the new tail becomes an array
        n, m = len(previous[0]), len(previous[1])
        if n + m and prompt_values[:n] == previous[0] and prompt_values[n:n + m] == previous[1]:
            return token_array(prompt_values[n + m:]), output, True
        return token_array(prompt_values), output, False
    prompt = prompt_values if checked else token_array(prompt_values)
    if previous is None:
        return prompt, output, False  # below: the previous turn's ids were checked as that turn's own
    prefix = np.concatenate([np.asarray(previous[0], dtype="<i4"), np.asarray(previous[1], dtype="<i4")])
    if len(prefix) and len(prompt) >= len(prefix) and np.array_equal(prompt[:len(prefix)], prefix):
        return prompt[len(prefix):], output, True
    return prompt, output, False


def _int32(values: Any, what: str) -> np.ndarray:
    array_ = values if isinstance(values, np.ndarray) else np.asarray(values if len(values) else [], dtype=np.int64)
    if array_.dtype.kind not in "iu" or (array_.size and (int(array_.min()) < 0 or int(array_.max()) > TOKEN_ID_MAX)):
        raise PackingError(f"{what} must be int32 values >= 0")
    return array_.astype("<i4", copy=False)


def _pack_replay(meta: dict[str, Any], experts: Any, experts_start: Any, top_p_ids: Any, top_p_offsets: Any,
                 outputs: int) -> list[bytes]:
    """The replay arrays of one turn (routed experts, top-p ids and offsets), sizes noted in `meta`."""
    chunks: list[bytes] = []
    if experts is not None:
        packed = _int32(experts, "routed_experts")
        meta["re"], meta["rs"] = int(packed.size), int(experts_start or 0)
        chunks.append(packed.tobytes())
    if top_p_ids is not None:
        ids, offsets = _int32(top_p_ids, "top_p_token_ids"), _int32(top_p_offsets, "top_p_token_offsets")
        if offsets.size != outputs + 1:
            raise PackingError("top_p_token_offsets must hold output_ids + 1 values")
        meta["tp"] = int(ids.size)
        chunks.extend([ids.tobytes(), offsets.tobytes()])
    return chunks


def replay_size(meta: dict[str, Any], outputs: int) -> int:
    """Bytes of a turn's replay arrays."""
    size = 4 * int(meta.get("re", 0))
    if "tp" in meta:
        size += 4 * (int(meta["tp"]) + outputs + 1)
    return size


def _read_replay(view: memoryview, offset: int, meta: dict[str, Any], outputs: int, turn: dict[str, Any], *,
                 arrays: bool) -> int:
    """Put a turn's `calls` and replay arrays into `turn` (numpy arrays, read-only, or lists); returns the
    offset after them."""
    if meta.get("calls") is not None:
        turn["calls"] = meta["calls"]

    def take(count: int) -> Any:
        nonlocal offset
        values = _native(np.frombuffer(view[offset:offset + 4 * count], dtype="<i4"))
        offset += 4 * count
        if not arrays:
            return values.tolist()
        values.flags.writeable = False
        return values

    if "re" in meta:
        turn["routed_experts"] = take(int(meta["re"]))
        turn["routed_experts_start_len"] = int(meta.get("rs", 0))
    if "tp" in meta:
        turn["top_p_token_ids"] = take(int(meta["tp"]))
        turn["top_p_token_offsets"] = take(outputs + 1)
    return offset


def read_header(blob: bytes) -> tuple[dict[str, Any], int]:
    """The JSON header of a packed record (with its `_turns` metadata) and where the arrays start."""
    if len(blob) < 3 + _HEADER_LEN.size or blob[:3] != MAGIC:
        raise PackingError("not a packed rollout record (bad magic)")
    (head_len,) = _HEADER_LEN.unpack_from(blob, 3)
    start = 3 + _HEADER_LEN.size
    if start + head_len > len(blob):
        raise PackingError("packed record is shorter than its header length")
    try:
        header = orjson.loads(blob[start : start + head_len])
    except orjson.JSONDecodeError as exc:
        raise PackingError(f"packed record header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise PackingError("packed record header is not a JSON object")
    return header, start + head_len


def check_arrays(blob: bytes, header: dict[str, Any], offset: int) -> None:
    """Validates a packed record's arrays without unpacking them: sizes add up to the blob, token ids are
    non-negative, logprobs are finite or -inf. Vectorised, so a batch of thousands of tokens costs
    microseconds."""
    metas = header.get("_turns")
    if metas is None:
        if offset != len(blob):
            raise PackingError("packed record without turns has trailing bytes")
        return
    if not isinstance(metas, list):
        raise PackingError("_turns must be a list")
    view = memoryview(blob)
    for i, meta in enumerate(metas):
        # exactly what pack_record writes, with exact types: what is accepted here is what a read unpacks
        if not isinstance(meta, dict) or not _META_KEYS <= set(meta) <= _META_KEYS | _OPTIONAL_META_KEYS:
            raise PackingError(f"turn {i}: bad array metadata (keys must be {sorted(_META_KEYS)} and any of "
                               f"{sorted(_OPTIONAL_META_KEYS)})")
        p, o, width, ext = meta["p"], meta["o"], meta["lp"], meta["ext"]
        if (any(type(x) is not int for x in (p, o, width)) or p < 0 or o < 0 or width not in (0, 4, 8)
                or not isinstance(ext, bool) or (ext and i == 0)
                or not isinstance(meta["finish_reason"], (str, type(None)))
                or type(meta["weight_version"]) not in (str, int, type(None))):
            raise PackingError(f"turn {i}: bad array metadata")
        _check_spans(i, meta.get("vs"), o)
        _check_replay_meta(i, meta)
        end = offset + 4 * (p + o) + width * o
        if end + replay_size(meta, o) > len(blob):
            raise PackingError(f"turn {i}: arrays run past the end of the record")
        ids = np.frombuffer(view[offset : offset + 4 * (p + o)], dtype="<i4")
        if ids.size and int(ids.min()) < 0:
            raise PackingError(f"turn {i}: negative token id")
        if width:
            logprobs = np.frombuffer(view[offset + 4 * (p + o) : end], dtype="<f4" if width == 4 else "<f8")
            if not (logprobs < np.inf).all():  # NaN and +inf both fail `<`
                raise PackingError(f"turn {i}: output_logprobs must be finite numbers (or -inf)")
        offset = end
        if "tp" in meta:
            offsets = np.frombuffer(view[offset + 4 * (meta.get("re", 0) + meta["tp"]):
                                         offset + replay_size(meta, o)], dtype="<i4")
            if int(offsets[0]) != 0 or int(offsets[-1]) != meta["tp"] or bool((np.diff(offsets) < 0).any()):
                raise PackingError(f"turn {i}: top-p offsets must run from 0 to the id count, never decreasing")
        replay = np.frombuffer(view[offset:offset + replay_size(meta, o)], dtype="<i4")
        if replay.size and int(replay.min()) < 0:
            raise PackingError(f"turn {i}: negative replay value")
        offset += replay_size(meta, o)
    if offset != len(blob):
        raise PackingError(f"packed record has {len(blob) - offset} trailing bytes")


def _check_replay_meta(index: int, meta: dict[str, Any]) -> None:
    """The optional replay keys: counts are ints >= 0, `rs` only with `re`, `calls` a list of objects."""
    for key in ("re", "rs", "tp"):
        if key in meta and (type(meta[key]) is not int or meta[key] < 0):
            raise PackingError(f"turn {index}: bad {key!r}")
    if "rs" in meta and "re" not in meta:
        raise PackingError(f"turn {index}: 'rs' without 're'")
    calls = meta.get("calls")
    if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
        raise PackingError(f"turn {index}: 'calls' must be a list of objects")


def _check_spans(index: int, spans: Any, outputs: int) -> None:
    """A turn's `vs` (version spans) must be [version, count] pairs covering its outputs exactly."""
    if spans is None:
        return
    try:
        counts = [int(span[1]) for span in spans if len(span) == 2]
    except (TypeError, ValueError) as exc:
        raise PackingError(f"turn {index}: bad version spans ({exc})") from exc
    if len(counts) != len(spans) or any(c < 0 for c in counts) or sum(counts) != outputs:
        raise PackingError(f"turn {index}: version spans must be [version, count] pairs covering its {outputs} "
                           "output tokens")


def with_header(blob: bytes, header: dict[str, Any], offset: int) -> bytes:
    """The same arrays under a new header (the store stamps `run_id` on what it keeps)."""
    head = orjson.dumps(header)
    return b"".join([MAGIC, _HEADER_LEN.pack(len(head)), head, memoryview(blob)[offset:]])


def unpack_record(blob: bytes) -> dict[str, Any]:
    """Inverse of `pack_record`: a plain dict with `turns` as lists of ints and floats."""
    if blob[:3] != MAGIC:
        raise PackingError("not a packed rollout record")
    (head_len,) = _HEADER_LEN.unpack_from(blob, 3)
    start = 3 + _HEADER_LEN.size
    record: dict[str, Any] = orjson.loads(blob[start : start + head_len])
    turn_meta = record.pop("_turns", None)
    if turn_meta is None:
        return record
    view = memoryview(blob)
    offset = start + head_len
    turns: list[dict[str, Any]] = []
    prefix: list[int] = []
    for meta in turn_meta:
        tail = _from_le("i", view[offset : offset + 4 * meta["p"]])
        offset += 4 * meta["p"]
        output = _from_le("i", view[offset : offset + 4 * meta["o"]])
        offset += 4 * meta["o"]
        logprobs: list[float] | None = None
        width = meta["lp"]
        if width:
            logprobs = _from_le("f" if width == 4 else "d", view[offset : offset + width * meta["o"]])
            offset += width * meta["o"]
        prompt = prefix + tail if meta["ext"] else tail
        turn = {"prompt_ids": prompt, "output_ids": output, "output_logprobs": logprobs,
                "finish_reason": meta["finish_reason"], "weight_version": meta["weight_version"]}
        if meta.get("vs") is not None:
            turn["version_spans"] = meta["vs"]
        offset = _read_replay(view, offset, meta, meta["o"], turn, arrays=False)
        turns.append(turn)
        prefix = prompt + output
    if offset != len(blob):
        raise PackingError(f"packed record has {len(blob) - offset} trailing bytes")
    record["turns"] = turns
    return record


def header_bytes(header: dict[str, Any]) -> bytes:
    """What precedes a packed record's arrays: `with_header(blob, header, offset)` is these bytes followed by
    `blob[offset:]`, so a writer can send the two parts without joining them first."""
    head = orjson.dumps(header)
    return b"".join([MAGIC, _HEADER_LEN.pack(len(head)), head])


def _native(values: np.ndarray) -> np.ndarray:
    """A little-endian array in native byte order (a copy only on big-endian machines)."""
    return values.astype(values.dtype.newbyteorder("="), copy=False) if _SWAP else values


def unpack_record_arrays(blob: bytes) -> tuple[dict[str, Any], list[dict[str, Any]] | None, int]:
    """`unpack_record` without a Python object per token: each turn's `prompt_ids` and `output_ids` are
    read-only int32 numpy arrays and its `output_logprobs` a read-only float64 array (float32-stored values
    widen exactly). All ids of a record live in one array and each turn's sequences are views of it (a
    prompt that extends the previous turn is the history so far, not a copy). Returns the record, its turn
    metadata (`_turns`, None without turns) and where its arrays start in `blob`, so a reader can put a new
    header over the same arrays (`with_header`). Raises PackingError when the arrays and the metadata do
    not add up to the blob."""
    record, offset = read_header(blob)
    metas = record.pop("_turns", None)
    if metas is None:
        if offset != len(blob):
            raise PackingError("packed record without turns has trailing bytes")
        return record, None, offset
    if not isinstance(metas, list):
        raise PackingError("_turns must be a list")
    view = memoryview(blob)
    id_bytes: list[memoryview] = []
    lp_bytes: list[tuple[memoryview, str]] = []
    layout: list[tuple[int, int, bool, int, int]] = []  # per turn: prompt tail, outputs, ext, logprob width, replay at
    position = offset
    for i, meta in enumerate(metas):
        try:
            p, o, width, ext = int(meta["p"]), int(meta["o"]), int(meta["lp"]), bool(meta["ext"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PackingError(f"turn {i}: bad array metadata ({exc})") from exc
        if p < 0 or o < 0 or width not in (0, 4, 8) or (ext and i == 0):
            raise PackingError(f"turn {i}: bad array metadata")
        end = position + 4 * (p + o) + width * o
        try:
            replay = replay_size(meta, o)
        except (TypeError, ValueError) as exc:
            raise PackingError(f"turn {i}: bad replay metadata ({exc})") from exc
        if end + replay > len(blob):
            raise PackingError(f"turn {i}: arrays run past the end of the record")
        id_bytes.append(view[position:position + 4 * (p + o)])
        if width:
            lp_bytes.append((view[position + 4 * (p + o):end], "<f4" if width == 4 else "<f8"))
        layout.append((p, o, ext, width, end))
        position = end + replay
    if position != len(blob):
        raise PackingError(f"packed record has {len(blob) - position} trailing bytes")
    ids = _native(np.frombuffer(b"".join(id_bytes), dtype="<i4"))  # one copy of all ids, one array
    kinds = {kind for _, kind in lp_bytes}
    if len(kinds) == 1:
        logprobs = np.frombuffer(b"".join(chunk for chunk, _ in lp_bytes), dtype=kinds.pop()).astype(np.float64)
    else:  # no logprobs, or float32 and float64 turns in one record
        logprobs = np.concatenate([np.frombuffer(chunk, dtype=kind) for chunk, kind in lp_bytes] or [np.empty(0)],
                                  dtype=np.float64)
    ids.flags.writeable = False
    logprobs.flags.writeable = False
    turns: list[dict[str, Any]] = []
    start = at = lp_at = 0  # where the current history began, the next turn's ids, its logprobs
    for meta, (p, o, ext, width, replay_at) in zip(metas, layout):
        if not ext:
            start = at
        turn = {"prompt_ids": ids[start:at + p], "output_ids": ids[at + p:at + p + o],
                "output_logprobs": logprobs[lp_at:lp_at + o] if width else None,
                "finish_reason": meta.get("finish_reason"), "weight_version": meta.get("weight_version")}
        if meta.get("vs") is not None:
            turn["version_spans"] = meta["vs"]
        _read_replay(view, replay_at, meta, o, turn, arrays=True)
        turns.append(turn)
        at += p + o
        lp_at += o if width else 0
    record["turns"] = turns
    return record, metas, offset
