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


def _ids(turn: simdjson.Object, key: str) -> np.ndarray:
    try:
        values = np.frombuffer(turn[key].as_buffer(of_type="i"), dtype=np.int64)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _Unusual(key) from exc
    try:
        return token_array(values)
    except PackingError as exc:
        raise _Unusual(key) from exc


def _turn(turn: Any) -> ArrayTurn:
    if not isinstance(turn, simdjson.Object):
        raise _Unusual("turn")
    # rare in an HTTP write (workers record them): the model's rules. One look at the keys, not a `get`
    # per key: a missing key costs simdjson a raised and caught error (~2 us each, 6 per turn)
    for key in _MODEL_TURN_KEYS.intersection(turn.keys()):
        if turn[key] is not None:
            raise _Unusual(key)
    prompt, output = _ids(turn, "prompt_ids"), _ids(turn, "output_ids")
    raw = turn.get("output_logprobs")
    logprobs = None
    if raw is not None:
        try:
            logprobs = np.frombuffer(raw.as_buffer(of_type="d"), dtype=np.float64)
        except (TypeError, ValueError, AttributeError) as exc:
            raise _Unusual("output_logprobs") from exc
        if len(logprobs) != len(output) or not (logprobs < np.inf).all():  # NaN and +inf both fail `<`
            raise _Unusual("output_logprobs")
    finish_reason, version = turn.get("finish_reason"), turn.get("weight_version")
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise _Unusual("finish_reason")
    if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
        raise _Unusual("weight_version")
    return ArrayTurn(prompt, output, logprobs, finish_reason, version)


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
    return fields, [_turn(turn) for turn in raw_turns]


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
