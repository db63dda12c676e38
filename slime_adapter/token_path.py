"""Token path: training pieces built straight from the engine's own ids (`turns`), never re-tokenized.

Each later turn's prompt must extend the tokens held so far; the new tail (tool results, user text,
template scaffolding) gets mask 0, the sampled output mask 1. A prompt that does not extend the history
(the worker re-rendered and the ids drifted) cannot be masked exactly, so the trajectory forks: the piece
so far is closed and a new one starts from that turn's prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
            self.log_probs.extend(float(x) for x in turn.output_logprobs)
        self.weight_versions.append(turn.weight_version)
        self.last_turn = index
        self.finish_reason = turn.finish_reason

    def finish(self) -> TokenPiece:
        response_length = len(self.tokens) - self.prompt_length
        log_probs = self.log_probs if self.has_log_probs else None
        assert len(self.loss_mask) == response_length, "loss_mask length != response_length"
        assert log_probs is None or len(log_probs) == response_length, "rollout_log_probs length != response_length"
        return TokenPiece(
            tokens=self.tokens,
            prompt_length=self.prompt_length,
            loss_mask=self.loss_mask,
            rollout_log_probs=log_probs,
            first_turn=self.first_turn,
            last_turn=self.last_turn,
            weight_versions=self.weight_versions,
            finish_reason=self.finish_reason,
            offpolicy_masked=self.offpolicy_masked,
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


def build_token_pieces(turns: Sequence[Turn | dict[str, Any]], *, mask_offpolicy: bool = False) -> TokenPathResult:
    """Cut a trajectory's `turns` into token-exact pieces (one, plus one per fork). With `mask_offpolicy`,
    generated tokens older than the newest policy version in the trajectory get mask 0 (counted)."""
    if not turns:
        raise ValueError("token path needs at least one turn")
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
