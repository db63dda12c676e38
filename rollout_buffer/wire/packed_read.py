"""The binary form of a `/get_rollout_data` answer (`Accept: application/x-rollout-buffer-packed`).

Body: a little-endian u32 length and the JSON envelope (the JSON answer without its records:
`{"success", "message", "data": {"meta_info", "count"}}`), then `count` records, each a u32 length and
the record in the store's packed form (`rollout_buffer.wire.packing`: a JSON header, then the token ids and
logprobs as little-endian arrays). The arrays travel as Redis holds them, so neither side makes a Python
object per token. Each record's header is the record as the JSON answer shows it after the group hooks ran
(reward normalisation, `epoch`, ...): the server puts the new header over the stored arrays (as
`packing.with_header` does, without copying them twice), and packs the record again only when a hook
changed its turns.

`decode` gives the JSON answer's shape back, with each turn's `prompt_ids` / `output_ids` as read-only
int32 numpy arrays and `output_logprobs` as float64 ones. A wire-format module: the trainer side imports
it (with `packing` and `schema`), nothing else of the service.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from operator import is_
from typing import Any

import orjson

from rollout_buffer.wire.packing import PackingError, header_bytes, pack_record, unpack_record_arrays
from rollout_buffer.wire.shared_prefix import expand

CONTENT_TYPE = "application/x-rollout-buffer-packed"
JSON_TYPE = "application/json"
_LEN = struct.Struct("<I")


class PackedReadError(ValueError):
    """A packed answer that cannot be decoded; the message says where it breaks."""


@dataclass(frozen=True, slots=True)
class StoredArrays:
    """A record's packed blob as Redis gave it, and the turn objects handed out for it: while a record still
    holds exactly these turns, its packed form is its new header over the same arrays."""

    blob: bytes
    offset: int
    turn_meta: list[dict[str, Any]] | None
    turns: list[dict[str, Any]] | None
    given: tuple[tuple[Any, ...], ...]


def stored_record(blob: bytes) -> tuple[dict[str, Any], StoredArrays]:
    """A stored blob as a record with array turns (`packing.unpack_record_arrays`), and what it takes to
    re-stamp it (`record_parts`). A record stored with shared prefixes (`shared_prefix`) is expanded first:
    what goes out is the packed form every reader knows."""
    blob = expand(blob)
    record, meta, offset = unpack_record_arrays(blob)
    turns = record.get("turns")
    given = tuple(tuple(turn.values()) for turn in turns) if turns is not None else ()
    return record, StoredArrays(blob, offset, meta, turns, given)


def _turns_untouched(record: dict[str, Any], stored: StoredArrays) -> bool:
    """Every turn still holds exactly the objects it was handed out with (compared by identity: a value set
    again, even an equal one, counts as a change and only costs a fresh packing)."""
    turns = record.get("turns")
    if turns is None or stored.turns is None:
        return turns is None and stored.turns is None
    if not isinstance(turns, list) or len(turns) != len(stored.given):
        return False
    for turn, given in zip(turns, stored.given):
        if not isinstance(turn, dict) or len(turn) != len(given) or not all(map(is_, turn.values(), given)):
            return False
    return True


def record_parts(record: dict[str, Any], stored: StoredArrays | None) -> list[bytes | memoryview]:
    """The record in packed form, in pieces: its header over the stored arrays when its turns are the ones
    handed out (hooks changed only header fields), else packed anew from whatever turns it now holds."""
    if stored is not None and _turns_untouched(record, stored):
        header = {k: v for k, v in record.items() if k != "turns"}
        if stored.turn_meta is not None:
            header["_turns"] = stored.turn_meta
        return [header_bytes(header), memoryview(stored.blob)[stored.offset:]]
    return [pack_record(record)]


def record_bytes(record: dict[str, Any], stored: StoredArrays | None) -> bytes:
    """`record_parts` joined: the record as `packing.unpack_record` reads it."""
    return b"".join(record_parts(record, stored))


def encode_answer(body: dict[str, Any], stored: dict[str, StoredArrays] | None = None) -> bytes:
    """A JSON-shaped answer (`{"success", "message", "data": {"data": [...], "meta_info"}}`) in packed form;
    `stored` maps uid -> the record's stored arrays (records without an entry are packed anew)."""
    data = body.get("data") or {}
    records = data.get("data") or []
    envelope = {**{k: v for k, v in body.items() if k != "data"},
                "data": {**{k: v for k, v in data.items() if k != "data"}, "count": len(records)}}
    head = orjson.dumps(envelope, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    parts = [_LEN.pack(len(head)), head]
    sources = stored or {}
    for record in records:
        pieces = record_parts(record, sources.get(str(record.get("uid"))))
        parts.append(_LEN.pack(sum(len(piece) for piece in pieces)))
        parts += pieces
    return b"".join(parts)  # the only copy of the arrays on the way out


def _chunk(body: bytes, offset: int, what: str) -> tuple[memoryview, int]:
    if offset + _LEN.size > len(body):
        raise PackedReadError(f"{what}: truncated length prefix at byte {offset} of {len(body)}")
    (length,) = _LEN.unpack_from(body, offset)
    start = offset + _LEN.size
    if start + length > len(body):
        raise PackedReadError(f"{what}: {length} bytes announced at byte {offset}, only "
                              f"{len(body) - start} left (truncated body)")
    return memoryview(body)[start:start + length], start + length


def decode(body: bytes) -> dict[str, Any]:
    """A packed answer in the JSON answer's shape, turns as numpy arrays (module docstring). Raises
    `PackedReadError` naming the broken part: a truncated body, a bad envelope, a record that is not in
    packed form, a count that does not match, trailing bytes."""
    raw, offset = _chunk(body, 0, "envelope")
    try:
        envelope = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise PackedReadError(f"envelope is not JSON: {exc}") from exc
    data = envelope.get("data") if isinstance(envelope, dict) else None
    count = data.get("count") if isinstance(data, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise PackedReadError("envelope must be an object with data.count, the number of records")
    records: list[dict[str, Any]] = []
    for index in range(count):
        blob, offset = _chunk(body, offset, f"record {index} of {count}")
        try:
            record, _, _ = unpack_record_arrays(blob)  # type: ignore[arg-type]  # arrays stay views of `body`
        except PackingError as exc:
            raise PackedReadError(f"record {index} of {count}: {exc}") from exc
        records.append(record)
    if offset != len(body):
        raise PackedReadError(f"{len(body) - offset} bytes after the last of {count} records")
    del data["count"]
    data["data"] = records
    return envelope


def _media_ranges(accept: str) -> dict[str, float]:
    """Media type -> quality of an Accept header (RFC 9110; parameters other than q are ignored)."""
    ranges: dict[str, float] = {}
    for item in accept.split(","):
        kind, *params = (part.strip() for part in item.split(";"))
        if not kind:
            continue
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        ranges[kind.lower()] = max(quality, ranges.get(kind.lower(), 0.0))
    return ranges


def wants_packed(accept: str | None) -> bool:
    """True when the client prefers the packed form: it names it with a quality above 0 and at least that
    of JSON (explicit or by wildcard). Anything else, no Accept header included, gets JSON."""
    if not accept:
        return False
    ranges = _media_ranges(accept)
    packed = ranges.get(CONTENT_TYPE, 0.0)
    json_quality = max(ranges.get(JSON_TYPE, 0.0), ranges.get("application/*", 0.0), ranges.get("*/*", 0.0))
    return packed > 0 and packed >= json_quality


def accept_header(packed: bool) -> str:
    """What a client that wants the packed form (or JSON) sends as Accept."""
    return f"{CONTENT_TYPE}, {JSON_TYPE};q=0.5" if packed else JSON_TYPE
