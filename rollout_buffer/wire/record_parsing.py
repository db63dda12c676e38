"""Parsing trajectory records without a Python object per token.

A realistic record carries thousands of token ids and logprobs. Parsed the ordinary way (pydantic's JSON
parser) each number becomes a Python int or float that is validated, packed into an array, and freed:
most of a write's CPU time (profile in `bench/README.md`). Here the body is parsed by simdjson, and each
turn's `prompt_ids`, `output_ids` and `output_logprobs` come out as numpy arrays straight from the
parsed document; only the small rest of the record (messages, reward, ...) goes through the pydantic
model, whose rules are unchanged.

Anything unusual about the turns (a missing key, a number that is not an integer, a logprob that is not
finite, per-token `version_spans`) makes the fast path step aside: the record is then parsed by the pydantic model alone, so every
refusal keeps its exact message. Results are identical either way (`tests/wire/test_record_parsing.py`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import simdjson
from pydantic import ValidationError

from rollout_buffer.wire.packing import PackingError, token_array
from rollout_buffer.wire.schema import MAX_BATCH_RECORDS, BatchWriteRequest, TrajectoryRecord

_local = threading.local()
# Turn fields the fast path leaves to the model: version spans, engine calls' meta, replay arrays.
_MODEL_TURN_KEYS = frozenset(("version_spans", "calls", "routed_experts", "routed_experts_start_len",
                              "top_p_token_ids", "top_p_token_offsets"))


@dataclass(slots=True)
class ArrayTurn:
    """One engine call with its sequences as arrays (what `packing.pack_record` reads by attribute); the id
    arrays are int32 and range-checked already (`ids_checked`: packing does not check them again)."""

    ids_checked: ClassVar[bool] = True

    prompt_ids: np.ndarray
    output_ids: np.ndarray
    output_logprobs: np.ndarray | None
    finish_reason: str | None
    weight_version: str | int | None


@dataclass(slots=True)
class ParsedRecord:
    """A validated record: the pydantic model of everything but the turns, and the turns as arrays (or,
    when the fast path stepped aside, the model's own `turns` and `array_turns` None)."""

    record: TrajectoryRecord
    array_turns: list[ArrayTurn] | None = None

    def to_store(self) -> dict[str, Any]:
        data = self.record.to_store()
        if self.array_turns is not None:
            data["turns"] = self.array_turns
        return data


class _Unusual(Exception):
    """The fast path cannot decide this record; the pydantic model will."""


def _parser() -> simdjson.Parser:
    parser = getattr(_local, "parser", None)
    if parser is None:
        parser = _local.parser = simdjson.Parser()
    return parser


def _plain(value: Any) -> Any:
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def _buffer(value: Any, of_type: str, key: str) -> memoryview:
    try:
        return memoryview(value.as_buffer(of_type=of_type))
    except (TypeError, ValueError, AttributeError) as exc:  # not an array of numbers of that type (or null)
        raise _Unusual(key) from exc


def _turn_parts(turn: Any) -> tuple[memoryview, memoryview, memoryview | None, Any, Any]:
    """One turn's id and logprob buffers (int64, float64) and its small fields, with the per-turn checks."""
    if not isinstance(turn, simdjson.Object):
        raise _Unusual("turn")
    # One look at the keys, not a `get` per optional key: a missing key costs simdjson a raised and caught
    # error (~2 us each). The keys the fast path leaves to the model are rare in an HTTP write.
    present = set(turn.keys())
    for key in _MODEL_TURN_KEYS.intersection(present):
        if turn[key] is not None:
            raise _Unusual(key)
    if "prompt_ids" not in present or "output_ids" not in present:
        raise _Unusual("ids")
    prompt, output = _buffer(turn["prompt_ids"], "i", "prompt_ids"), _buffer(turn["output_ids"], "i", "output_ids")
    raw = turn["output_logprobs"] if "output_logprobs" in present else None
    logprobs = None if raw is None else _buffer(raw, "d", "output_logprobs")
    if logprobs is not None and logprobs.nbytes != output.nbytes:
        raise _Unusual("output_logprobs")
    finish_reason = turn["finish_reason"] if "finish_reason" in present else None
    version = turn["weight_version"] if "weight_version" in present else None
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise _Unusual("finish_reason")
    if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
        raise _Unusual("weight_version")
    return prompt, output, logprobs, finish_reason, version


def _turns(raw_turns: simdjson.Array) -> list[ArrayTurn]:
    """Every turn's arrays, checked all at once: the ids of all turns are one array (one range check, one
    int32 conversion) and so are the logprobs, each turn's arrays views of them; a dozen numpy calls per
    record instead of a dozen per turn."""
    parts = [_turn_parts(turn) for turn in raw_turns]
    ids = np.frombuffer(b"".join(b for part in parts for b in part[:2]), dtype=np.int64)
    try:
        ids = token_array(ids)
    except PackingError as exc:
        raise _Unusual("ids") from exc
    logprobs = np.frombuffer(b"".join(part[2] for part in parts if part[2] is not None), dtype=np.float64)
    if not (logprobs < np.inf).all():  # NaN and +inf both fail `<`
        raise _Unusual("output_logprobs")
    turns, at, lp_at = [], 0, 0
    for prompt, output, lp, finish_reason, version in parts:
        p, o = prompt.nbytes // 8, output.nbytes // 8
        turn_logprobs = None if lp is None else logprobs[lp_at:lp_at + o]
        lp_at += 0 if lp is None else o
        turns.append(ArrayTurn(ids[at:at + p], ids[at + p:at + p + o], turn_logprobs, finish_reason, version))
        at += p + o
    return turns


def _document(body: bytes) -> Any:
    for attempt in (1, 2):
        try:
            return _parser().parse(body)
        except RuntimeError as exc:  # proxies of an earlier document still alive, or JSON simdjson cannot
            if attempt == 2:  # hold (integers beyond 64 bits): a fresh parser, then the model decides
                raise _Unusual("simdjson") from exc
            _local.parser = None
        except ValueError as exc:  # not JSON: the model's parser names the problem
            raise _Unusual("json") from exc
    raise AssertionError("unreachable")


def _split(document: Any) -> tuple[dict[str, Any], list[ArrayTurn] | None]:
    """A record object's fields other than `turns` as plain values, and its turns as arrays."""
    if not isinstance(document, simdjson.Object):
        raise _Unusual("not an object")
    keys = list(document.keys())
    if len(set(keys)) == len(keys) and not any("\x00" in key for key in keys):
        # one lookup per key: `items()` would turn every value into Python objects, the turns' numbers too
        fields = {key: _plain(document[key]) for key in keys if key != "turns"}
    else:  # a key lookup stops at a NUL in the key (found by the API fuzz test); a repeated key: the last wins
        fields = {key: value for key, value in document.items() if key != "turns"}
    raw_turns = document.get("turns")
    if raw_turns is None:
        return fields, None
    if not isinstance(raw_turns, simdjson.Array):
        raise _Unusual("turns")
    return fields, _turns(raw_turns)


def parse_record(body: bytes) -> ParsedRecord:
    """Validate one `/buffer/write` body; raises pydantic's `ValidationError` for a bad record."""
    try:
        fields, turns = _split(_document(body))
        return ParsedRecord(TrajectoryRecord.model_validate(fields), turns)
    except (_Unusual, ValidationError):
        pass  # leaving the except block frees the parsed document before the model parses the body again
    return ParsedRecord(TrajectoryRecord.model_validate_json(body))  # the model alone decides


def parse_batch(body: bytes) -> tuple[str | None, list[ParsedRecord]]:
    """Validate one `/buffer/write_batch` body: `(run_id, records)`; raises `ValidationError`."""
    try:
        document = _document(body)
        if not isinstance(document, simdjson.Object) or set(document.keys()) - {"run_id", "records"}:
            raise _Unusual("batch")
        raw = document.get("records")
        if not isinstance(raw, simdjson.Array) or not 1 <= len(raw) <= MAX_BATCH_RECORDS:
            raise _Unusual("records")
        run_id = document.get("run_id")
        if run_id is not None and not isinstance(run_id, str):
            raise _Unusual("run_id")
        parsed = []
        for item in raw:
            fields, turns = _split(item)
            parsed.append(ParsedRecord(TrajectoryRecord.model_validate(fields), turns))
        return run_id, parsed
    except (_Unusual, ValidationError):
        pass
    batch = BatchWriteRequest.model_validate_json(body)
    return batch.run_id, [ParsedRecord(record) for record in batch.records]
