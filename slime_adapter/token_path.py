"""Token path: training pieces built straight from the engine's own ids (`turns`), never re-tokenized.

Each later turn's prompt must extend the tokens held so far; the new tail (tool results, user text,
template scaffolding) gets mask 0, the sampled output mask 1. A prompt that does not extend the history
(the worker re-rendered and the ids drifted) cannot be masked exactly, so the trajectory forks: the piece
so far is closed and a new one starts from that turn's prompt.

The work is numpy array operations (prefix checks, concatenation, masks); each piece becomes slime's
lists once, at the end, so a packed read's arrays reach the Sample without a Python object per token
on the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_buffer.schema import Turn

__all__ = ["TokenPiece", "TokenPathResult", "build_token_pieces"]


@dataclass(frozen=True)
class TokenPiece:
    """One training sequence cut from a trajectory: the prompt, then response tokens with mask/logprobs."""

    tokens: list[int]
    prompt_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float] | None
    first_turn: int
    last_turn: int
    weight_versions: list[str | int | None]
    finish_reason: str | None
    #: generated tokens given mask 0 because a newer policy version generated later tokens of the record
    offpolicy_masked: int = 0

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def generated_tokens(self) -> int:
        """Tokens the policy sampled (mask 1)."""
        return sum(self.loss_mask)

    def stats(self) -> dict[str, int]:
        """Per-piece counts for logging: prompt, response (mask 0 and 1) and generated tokens."""
        return {
            "prompt_tokens": self.prompt_length,
            "response_tokens": self.response_length,
            "generated_tokens": self.generated_tokens,
            "turns": self.last_turn - self.first_turn + 1,
        }


@dataclass(frozen=True)
class TokenPathResult:
    """All pieces of one trajectory, in order; `forks` = pieces beyond the first."""

    pieces: list[TokenPiece]

    @property
    def forks(self) -> int:
        return len(self.pieces) - 1


@dataclass(frozen=True, slots=True)
class _TurnArrays:
    """One turn with its sequences as numpy arrays (from a validated `Turn`, or straight from a packed read)."""

    prompt: np.ndarray
    output: np.ndarray
    logprobs: np.ndarray | None
    finish_reason: str | None
    weight_version: str | int | None
    version_spans: list[Any] | None


@dataclass
class _PieceBuilder:
    """Accumulates one piece as array chunks; `history()` is exactly what the next prompt must extend."""

    first: _TurnArrays
    first_turn: int
    tokens: list[np.ndarray] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    log_probs: list[np.ndarray] = field(default_factory=list)
    has_log_probs: bool = True
    weight_versions: list[str | int | None] = field(default_factory=list)
    last_turn: int = -1
    finish_reason: str | None = None
    offpolicy_masked: int = 0
    prompt_length: int = 0
    length: int = 0
    _history: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.tokens.append(self.first.prompt)
        self.length = self.prompt_length = len(self.first.prompt)

    def history(self) -> np.ndarray:
        if self._history is None or len(self._history) != self.length:
            self._history = np.concatenate(self.tokens) if len(self.tokens) > 1 else self.tokens[0]
        return self._history

    def extends(self, prompt: np.ndarray) -> bool:
        return len(prompt) >= self.length and bool(np.array_equal(prompt[:self.length], self.history()))

    def _append(self, ids: np.ndarray, mask: np.ndarray, log_probs: np.ndarray) -> None:
        self.tokens.append(ids)
        self.mask.append(mask)
        self.log_probs.append(log_probs)
        self.length += len(ids)

    def add_context(self, ids: np.ndarray) -> None:
        self._append(ids, np.zeros(len(ids), dtype=np.int8), np.zeros(len(ids), dtype=np.float64))

    def add_output(self, index: int, turn: _TurnArrays, newest: int | None = None) -> None:
        n = len(turn.output)
        if newest is None:
            mask = np.ones(n, dtype=np.int8)
        else:  # train only what the newest version generated (slime's --mask-offpolicy-in-partial-rollout)
            versions = _token_versions(turn)
            mask = ((versions < 0) | (versions >= newest)).astype(np.int8)
            self.offpolicy_masked += n - int(mask.sum())
        if turn.logprobs is None:
            self.has_log_probs = False
            log_probs = np.zeros(n, dtype=np.float64)
        else:
            log_probs = turn.logprobs
        self._append(turn.output, mask, log_probs)
        self.weight_versions.append(turn.weight_version)
        self.last_turn = index
        self.finish_reason = turn.finish_reason

    def finish(self) -> TokenPiece:
        """The piece, converted to slime's lists once, here."""
        response_length = self.length - self.prompt_length
        tokens = np.concatenate(self.tokens).tolist()
        mask = np.concatenate(self.mask).tolist() if self.mask else []
        log_probs = (np.concatenate(self.log_probs).tolist() if self.log_probs else []) if self.has_log_probs else None
        assert len(mask) == response_length, "loss_mask length != response_length"
        assert log_probs is None or len(log_probs) == response_length, "rollout_log_probs length != response_length"
        return TokenPiece(
            tokens=tokens,
            prompt_length=self.prompt_length,
            loss_mask=mask,
            rollout_log_probs=log_probs,
            first_turn=self.first_turn,
            last_turn=self.last_turn,
            weight_versions=self.weight_versions,
            finish_reason=self.finish_reason,
            offpolicy_masked=self.offpolicy_masked,
        )


def _is_array_turn(turn: Any) -> bool:
    return isinstance(turn, dict) and isinstance(turn.get("output_ids"), np.ndarray)


def _array_turn(turn: dict[str, Any], index: int) -> _TurnArrays:
    """A turn of a packed read: its arrays as they are, with the checks the buffer's format does not imply."""
    prompt, output = np.asarray(turn["prompt_ids"]), np.asarray(turn["output_ids"])
    logprobs = turn.get("output_logprobs")
    if logprobs is not None:
        logprobs = np.asarray(logprobs, dtype=np.float64)
        if len(logprobs) != len(output):
            raise ValueError(f"turns[{index}].output_logprobs has {len(logprobs)} values for {len(output)} output_ids")
    if prompt.dtype.kind not in "iu" or output.dtype.kind not in "iu":
        raise ValueError(f"turns[{index}]: token ids must be integers")
    spans = turn.get("version_spans")
    if spans is not None and sum(int(count) for _, count in spans) != len(output):
        raise ValueError(f"turns[{index}].version_spans do not cover its {len(output)} output tokens")
    return _TurnArrays(prompt, output, logprobs, turn.get("finish_reason"), turn.get("weight_version"), spans)


def _as_arrays(turn: Turn | dict[str, Any], index: int) -> _TurnArrays:
    if _is_array_turn(turn):
        return _array_turn(turn, index)  # type: ignore[arg-type]
    parsed = turn if isinstance(turn, Turn) else Turn.model_validate(turn)
    logprobs = None if parsed.output_logprobs is None else np.asarray(parsed.output_logprobs, dtype=np.float64)
    return _TurnArrays(np.asarray(parsed.prompt_ids, dtype=np.int64), np.asarray(parsed.output_ids, dtype=np.int64),
                       logprobs, parsed.finish_reason, parsed.weight_version,
                       None if parsed.version_spans is None else [list(span) for span in parsed.version_spans])


def _version(value: str | int | None) -> int | None:
    """A policy version as an int; None for labels that are not one (SGLang's default "default")."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdecimal():
        return int(value)
    return None


def _span_versions(turn: _TurnArrays) -> list[tuple[int | None, int]]:
    """(version, output tokens) runs of a turn: its `version_spans`, else its `weight_version` for all."""
    if turn.version_spans:
        return [(_version(v), int(count)) for v, count in turn.version_spans]
    return [(_version(turn.weight_version), len(turn.output))]


def _token_versions(turn: _TurnArrays) -> np.ndarray:
    """The policy version each output token was generated under (-1: none), one array per turn."""
    runs = _span_versions(turn)
    return np.repeat(np.asarray([-1 if v is None else v for v, _ in runs], dtype=np.int64),
                     np.asarray([count for _, count in runs], dtype=np.int64))


def token_versions(turn: Turn | dict[str, Any]) -> list[int | None]:
    """The policy version each output token was generated under: from `version_spans` when the turn was
    aborted and continued under a newer version, else the turn's own `weight_version` for every token."""
    return [None if v < 0 else v for v in _token_versions(_as_arrays(turn, 0)).tolist()]


def build_token_pieces(turns: Sequence[Turn | dict[str, Any]], *, mask_offpolicy: bool = False) -> TokenPathResult:
    """Cut a trajectory's `turns` into token-exact pieces (one, plus one per fork). With `mask_offpolicy`,
    generated tokens older than the newest policy version in the trajectory get mask 0 (counted).

    Turns may be validated `Turn`s, dicts of lists (validated here), or dicts whose sequences are numpy
    arrays (a packed read): the work is array operations either way, lists are made once per piece."""
    if not turns:
        raise ValueError("token path needs at least one turn")
    parsed = [_as_arrays(raw, i) for i, raw in enumerate(turns)]
    newest = None
    if mask_offpolicy:
        versions = [v for turn in parsed for v, count in _span_versions(turn) if v is not None and count > 0]
        newest = max(versions) if versions else None
    pieces: list[TokenPiece] = []
    current: _PieceBuilder | None = None
    for index, turn in enumerate(parsed):
        if current is not None and current.extends(turn.prompt):
            current.add_context(turn.prompt[current.length:])
        else:
            if current is not None:
                pieces.append(current.finish())
            current = _PieceBuilder(first=turn, first_turn=index)
        current.add_output(index, turn, newest)
    assert current is not None
    pieces.append(current.finish())
    return TokenPathResult(pieces=pieces)
