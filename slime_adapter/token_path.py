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

    def extends(self, prompt_ids: Sequence[int]) -> bool:
        n = len(self.tokens)
        return len(prompt_ids) >= n and list(prompt_ids[:n]) == self.tokens

    def add_context(self, ids: Sequence[int]) -> None:
        self.tokens.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.log_probs.extend([0.0] * len(ids))

    def add_output(self, index: int, turn: Turn) -> None:
        self.tokens.extend(turn.output_ids)
        self.loss_mask.extend([1] * len(turn.output_ids))
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
        )


def _as_turn(turn: Turn | dict[str, Any]) -> Turn:
    return turn if isinstance(turn, Turn) else Turn.model_validate(turn)


def build_token_pieces(turns: Sequence[Turn | dict[str, Any]]) -> TokenPathResult:
    """Cut a trajectory's `turns` into token-exact pieces (one, plus one per fork)."""
    if not turns:
        raise ValueError("token path needs at least one turn")
    pieces: list[TokenPiece] = []
    current: _PieceBuilder | None = None
    for index, raw in enumerate(turns):
        turn = _as_turn(raw)
        if current is not None and current.extends(turn.prompt_ids):
            current.add_context(turn.prompt_ids[len(current.tokens):])
        else:
            if current is not None:
                pieces.append(current.finish())
            current = _PieceBuilder(tokens=list(turn.prompt_ids), prompt_length=len(turn.prompt_ids), first_turn=index)
        current.add_output(index, turn)
    assert current is not None
    pieces.append(current.finish())
    return TokenPathResult(pieces=pieces)
