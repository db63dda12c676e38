"""Token path: training pieces built straight from the engine's own ids (`turns`), never re-tokenized.

Each later turn's prompt must extend the tokens held so far; the new tail (tool results, user text,
template scaffolding) gets mask 0, the sampled output mask 1. A prompt that does not extend the history
(the worker re-rendered and the ids drifted) cannot be masked exactly, so the trajectory forks: the piece
so far is closed and a new one starts from that turn's prompt.

Turns come as validated `Turn`s or dicts of lists (a JSON read), built with list operations, or as dicts
whose sequences are numpy arrays (a packed read), built with array operations and made into slime's lists
once per piece, so a packed read's tokens reach the Sample without a Python object per token on the way.
Both follow the same rule (tests/adapter/test_packed_read_adapter.py checks them against one statement of it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_buffer.wire.schema import Turn

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


@dataclass
class _PieceBuilder:
    """Accumulates one piece; `tokens` is always exactly the history the next prompt must extend."""

    tokens: list[int]
    prompt_length: int
    first_turn: int
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    has_log_probs: bool = True
    weight_versions: list[str | int | None] = field(default_factory=list)
    last_turn: int = -1
    finish_reason: str | None = None
    offpolicy_masked: int = 0

    def extends(self, prompt_ids: Sequence[int]) -> bool:
        n = len(self.tokens)
        return len(prompt_ids) >= n and list(prompt_ids[:n]) == self.tokens

    def add_context(self, ids: Sequence[int]) -> None:
        self.tokens.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.log_probs.extend([0.0] * len(ids))

    def add_output(self, index: int, turn: Turn, newest: int | None = None) -> None:
        self.tokens.extend(turn.output_ids)
        if newest is None:
            self.loss_mask.extend([1] * len(turn.output_ids))
        else:  # train only what the newest version generated (slime's --mask-offpolicy-in-partial-rollout)
            mask = [0 if v is not None and v < newest else 1 for v in token_versions(turn)]
            self.offpolicy_masked += len(mask) - sum(mask)
            self.loss_mask.extend(mask)
        if turn.output_logprobs is None:
            self.has_log_probs = False
            self.log_probs.extend([0.0] * len(turn.output_ids))
        else:
            self.log_probs.extend(map(float, turn.output_logprobs))
        self.weight_versions.append(turn.weight_version)
        self.last_turn = index
        self.finish_reason = turn.finish_reason

    def finish(self) -> TokenPiece:
        return _piece(self, self.tokens, self.loss_mask, self.log_probs if self.has_log_probs else None)


@dataclass(frozen=True, slots=True)
class _TurnArrays:
    """One turn of a packed read, its sequences as numpy arrays."""

    prompt: np.ndarray
    output: np.ndarray
    logprobs: np.ndarray | None
    finish_reason: str | None
    weight_version: str | int | None
    version_spans: list[Any] | None


@dataclass
class _ArrayPieceBuilder:
    """`_PieceBuilder` for array turns: accumulates array chunks; `history()` is exactly what the next prompt
    must extend; lists are made once, in `finish`."""

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
            versions = _array_token_versions(turn)
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
        tokens = np.concatenate(self.tokens).tolist()
        mask = np.concatenate(self.mask).tolist() if self.mask else []
        log_probs = (np.concatenate(self.log_probs).tolist() if self.log_probs else []) if self.has_log_probs else None
        return _piece(self, tokens, mask, log_probs)


def _piece(builder: _PieceBuilder | _ArrayPieceBuilder, tokens: list[int], loss_mask: list[int],
           log_probs: list[float] | None) -> TokenPiece:
    """The finished piece of either builder; its mask and logprobs cover exactly the response."""
    response_length = len(tokens) - builder.prompt_length
    assert len(loss_mask) == response_length, "loss_mask length != response_length"
    assert log_probs is None or len(log_probs) == response_length, "rollout_log_probs length != response_length"
    return TokenPiece(
        tokens=tokens,
        prompt_length=builder.prompt_length,
        loss_mask=loss_mask,
        rollout_log_probs=log_probs,
        first_turn=builder.first_turn,
        last_turn=builder.last_turn,
        weight_versions=builder.weight_versions,
        finish_reason=builder.finish_reason,
        offpolicy_masked=builder.offpolicy_masked,
    )


def _as_turn(turn: Turn | dict[str, Any]) -> Turn:
    return turn if isinstance(turn, Turn) else Turn.model_validate(turn)


def _version(value: str | int | None) -> int | None:
    """A policy version as an int; None for labels that are not one (SGLang's default "default")."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdecimal():
        return int(value)
    return None


def token_versions(turn: Turn) -> list[int | None]:
    """The policy version each output token was generated under: from `version_spans` when the turn was
    aborted and continued under a newer version, else the turn's own `weight_version` for every token."""
    if turn.version_spans:
        return [_version(v) for v, count in turn.version_spans for _ in range(count)]
    return [_version(turn.weight_version)] * len(turn.output_ids)


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


def _span_versions(turn: _TurnArrays) -> list[tuple[int | None, int]]:
    """(version, output tokens) runs of a turn: its `version_spans`, else its `weight_version` for all."""
    if turn.version_spans:
        return [(_version(v), int(count)) for v, count in turn.version_spans]
    return [(_version(turn.weight_version), len(turn.output))]


def _array_token_versions(turn: _TurnArrays) -> np.ndarray:
    """`token_versions` as one array per turn (-1: no version)."""
    runs = _span_versions(turn)
    return np.repeat(np.asarray([-1 if v is None else v for v, _ in runs], dtype=np.int64),
                     np.asarray([count for _, count in runs], dtype=np.int64))


def _array_pieces(turns: Sequence[dict[str, Any]], mask_offpolicy: bool) -> list[TokenPiece]:
    parsed = [_array_turn(raw, i) for i, raw in enumerate(turns)]
    newest = None
    if mask_offpolicy:
        versions = [v for turn in parsed for v, count in _span_versions(turn) if v is not None and count > 0]
        newest = max(versions) if versions else None
    pieces: list[TokenPiece] = []
    current: _ArrayPieceBuilder | None = None
    for index, turn in enumerate(parsed):
        if current is not None and current.extends(turn.prompt):
            current.add_context(turn.prompt[current.length:])
        else:
            if current is not None:
                pieces.append(current.finish())
            current = _ArrayPieceBuilder(first=turn, first_turn=index)
        current.add_output(index, turn, newest)
    assert current is not None
    pieces.append(current.finish())
    return pieces


def build_token_pieces(turns: Sequence[Turn | dict[str, Any]], *, mask_offpolicy: bool = False) -> TokenPathResult:
    """Cut a trajectory's `turns` into token-exact pieces (one, plus one per fork). With `mask_offpolicy`,
    generated tokens older than the newest policy version in the trajectory get mask 0 (counted). Turns
    whose sequences are all numpy arrays take the array path (module docstring)."""
    if not turns:
        raise ValueError("token path needs at least one turn")
    if all(_is_array_turn(turn) for turn in turns):
        return TokenPathResult(pieces=_array_pieces(turns, mask_offpolicy))  # type: ignore[arg-type]
    parsed = [_as_turn(raw) for raw in turns]
    newest = None
    if mask_offpolicy:
        versions = [v for turn in parsed for v in token_versions(turn) if v is not None]
        newest = max(versions) if versions else None
    pieces: list[TokenPiece] = []
    current: _PieceBuilder | None = None
    for index, turn in enumerate(parsed):
        if current is not None and current.extends(turn.prompt_ids):
            current.add_context(turn.prompt_ids[len(current.tokens):])
        else:
            if current is not None:
                pieces.append(current.finish())
            current = _PieceBuilder(tokens=list(turn.prompt_ids), prompt_length=len(turn.prompt_ids), first_turn=index)
        current.add_output(index, turn, newest)
    assert current is not None
    pieces.append(current.finish())
    return TokenPathResult(pieces=pieces)
