"""The binary batch format of `/buffer/write_packed`: records already in the store's packed form.

Body (`application/x-rollout-records`): for each record a little-endian u32 byte length, then the record
as `rollout_buffer.wire.packing.pack_record` writes it. The server validates each record's header with the
same pydantic model as `/buffer/write` and its arrays with vectorised checks, then stores the arrays as
they came: no token list is ever built in Python. Writers that hold token ids as arrays (or that pack
records anyway) avoid JSON's per-number cost on both sides. `encode_batch` builds a body.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rollout_buffer.wire.packing import PackingError, check_arrays, pack_record, read_header, with_header
from rollout_buffer.wire.schema import TrajectoryRecord

CONTENT_TYPE = "application/x-rollout-records"
_LEN = struct.Struct("<I")


class PackedBatchError(ValueError):
    """A batch that cannot be stored; the message names the record by index (and uid when known)."""


@dataclass
class PackedItem:
    fields: dict[str, Any]  # uid, instance_id, epoch, reward, status, run_id: what the write script needs
    header: dict[str, Any]
    blob: bytes
    offset: int


def encode_batch(records: list[dict[str, Any]]) -> bytes:
    """A `/buffer/write_packed` body for plain record dicts."""
    parts: list[bytes] = []
    for record in records:
        blob = pack_record(record)
        parts += [_LEN.pack(len(blob)), blob]
    return b"".join(parts)


def decode_batch(body: bytes) -> list[PackedItem]:
    """Split and validate a body; raises PackedBatchError naming the first bad record."""
    items: list[PackedItem] = []
    offset = 0
    while offset < len(body):
        index = len(items)
        if offset + _LEN.size > len(body):
            raise PackedBatchError(f"record {index}: truncated length prefix")
        (length,) = _LEN.unpack_from(body, offset)
        offset += _LEN.size
        blob = body[offset : offset + length]
        offset += length
        if len(blob) != length:
            raise PackedBatchError(f"record {index}: body ends {length - len(blob)} bytes early")
        try:
            header, arrays_at = read_header(blob)
            check_arrays(blob, header, arrays_at)
            fields = {k: v for k, v in header.items() if k != "_turns"}
            validated = TrajectoryRecord.model_validate(fields)
        except PackingError as exc:
            raise PackedBatchError(f"record {index}: {exc}") from exc
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                                 for e in exc.errors()[:5])
            raise PackedBatchError(f"record {index} (uid {header.get('uid')!r}): {problems}") from exc
        stored_header = {**validated.model_dump(exclude={"turns"}), "_turns": header.get("_turns")}
        if stored_header["_turns"] is None:
            del stored_header["_turns"]
        items.append(PackedItem(fields=stored_header, header=stored_header, blob=blob, offset=arrays_at))
    if not items:
        raise PackedBatchError("empty batch")
    return items


def stamped_blob(item: PackedItem, run_id: str) -> bytes:
    """The record as the store keeps it: the validated header with `run_id`, the arrays untouched."""
    header = {**item.header, "run_id": run_id}
    if header.get("timestamp") is None:  # as `TrajectoryRecord.to_store`: the time the buffer stored it
        header["timestamp"] = time.time()
    return with_header(item.blob, header, item.offset)
