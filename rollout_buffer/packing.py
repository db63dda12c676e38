"""Stored form of a trajectory record: a JSON header plus packed token arrays.

Layout: `b"RB1"`, a little-endian u32 header length, the orjson header (the record without `turns`, plus
`_turns`: one small dict per turn), then the turns' arrays back to back. Token ids are int32. Logprobs
are float32 when every value survives the float32 round trip exactly (engines compute them in float32),
float64 otherwise, so what comes back is always bit-identical to what was written. A turn whose prompt
extends the previous turn's prompt + output stores only the new tail (`ext`), the usual multi-turn case,
so a 4-turn trajectory does not store its prompt four times.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson

MAGIC = b"RB1"
_HEADER_LEN = struct.Struct("<I")


class PackingError(ValueError):
    pass


def pack_record(record: dict[str, Any]) -> bytes:
    """Serialize a validated record (plain dict, `turns` as dicts of lists) to bytes."""
    turns = record.get("turns")
    header = {k: v for k, v in record.items() if k != "turns"}
    chunks: list[bytes] = []
    if turns is not None:
        turn_meta: list[dict[str, Any]] = []
        prefix = np.empty(0, dtype=np.int64)
        for turn in turns:
            prompt = np.asarray(turn["prompt_ids"], dtype=np.int64)
            output = np.asarray(turn["output_ids"], dtype=np.int64)
            extends = len(prefix) > 0 and len(prompt) >= len(prefix) and np.array_equal(prompt[: len(prefix)], prefix)
            stored_prompt = prompt[len(prefix):] if extends else prompt
            meta: dict[str, Any] = {
                "ext": bool(extends),
                "p": int(len(stored_prompt)),
                "o": int(len(output)),
                "finish_reason": turn.get("finish_reason"),
                "weight_version": turn.get("weight_version"),
            }
            chunks.append(stored_prompt.astype("<i4").tobytes())
            chunks.append(output.astype("<i4").tobytes())
            logprobs = turn.get("output_logprobs")
            if logprobs is None:
                meta["lp"] = 0
            else:
                as64 = np.asarray(logprobs, dtype=np.float64)
                as32 = as64.astype(np.float32)
                if np.array_equal(as32.astype(np.float64), as64):
                    meta["lp"] = 4
                    chunks.append(as32.astype("<f4").tobytes())
                else:
                    meta["lp"] = 8
                    chunks.append(as64.astype("<f8").tobytes())
            turn_meta.append(meta)
            prefix = np.concatenate([prompt, output])
        header["_turns"] = turn_meta
    head = orjson.dumps(header)
    return b"".join([MAGIC, _HEADER_LEN.pack(len(head)), head, *chunks])


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
        tail = np.frombuffer(view[offset : offset + 4 * meta["p"]], dtype="<i4").tolist()
        offset += 4 * meta["p"]
        output = np.frombuffer(view[offset : offset + 4 * meta["o"]], dtype="<i4").tolist()
        offset += 4 * meta["o"]
        logprobs: list[float] | None = None
        width = meta["lp"]
        if width:
            dtype = "<f4" if width == 4 else "<f8"
            logprobs = np.frombuffer(view[offset : offset + width * meta["o"]], dtype=dtype).astype(np.float64).tolist()
            offset += width * meta["o"]
        prompt = prefix + tail if meta["ext"] else tail
        turns.append(
            {
                "prompt_ids": prompt,
                "output_ids": output,
                "output_logprobs": logprobs,
                "finish_reason": meta["finish_reason"],
                "weight_version": meta["weight_version"],
            }
        )
        prefix = prompt + output
    if offset != len(blob):
        raise PackingError(f"packed record has {len(blob) - offset} trailing bytes")
    record["turns"] = turns
    return record
