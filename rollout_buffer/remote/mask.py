"""The `response_mask` of each call to a trainer-hosted engine, counted the way the protocol defines it.

The trainer keeps its own token list per rollout: the first prompt, then each call's sampled `token_ids`. On a
later call it appends the tokens the history gained that the model did not sample, and the buffer sends
`[0] * n` for them, with n by the protocol's own formula on the messages exactly as sent:

    n = len(render(messages, tools, add_generation_prompt=True)) - last_prompt_length
    last_prompt_length = len(previous prompt) + len(previous token_ids)

A trainer computes the same n from the same body and rejects a mask of another length, so n is never
adjusted: where the template re-renders the previous reply differently from the model's `token_ids` the
count still follows the formula and the difference is reported as drift (`remote.drift`). Two cases have no
count a trainer could accept, and raise `MaskCountError` instead of sending anything: a negative n (the
render is shorter than what the trainer holds, e.g. a template that drops earlier reasoning) and a previous
answer without `token_ids` (the formula needs them).
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.remote.drift import Drift, measure_drift
from rollout_buffer.tasks.contract import HistoryRewriteError

_EOT_TOKEN = "<|im_end|>"


def end_of_turn_id(tokenizer: Any) -> int:
    """The token the chat template closes every turn with: `<|im_end|>` for ChatML, else EOS."""
    token_id = tokenizer.convert_tokens_to_ids(_EOT_TOKEN)
    if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id >= 0:
        return token_id
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has neither <|im_end|> nor an EOS token; cannot find turn ends")
    return int(tokenizer.eos_token_id)


class MaskCountError(HistoryRewriteError):
    """No response_mask a trainer could accept exists for this call; `reason` names the case."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ResponseMaskCounter:
    """Remembers the previous call's rendered prompt and the model's ids for it; counts each new call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eot = end_of_turn_id(tokenizer)
        self.last_prompt: list[int] | None = None
        self.last_output: list[int] | None = None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The prompt ids of a request body's `messages` and `tools`, with the generation prompt."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count(self, prompt: list[int], call_index: int) -> tuple[int, Drift | None]:
        """(n, drift) for the call whose rendered prompt is `prompt`; raises MaskCountError when no n exists."""
        if self.last_prompt is None:
            raise RuntimeError("count() before the first call was committed")
        if self.last_output is None:
            raise MaskCountError(
                "no_token_ids", "the trainer's previous answer carried no token_ids, and the protocol's "
                "response_mask count (len(render) - (previous prompt length + len(previous token_ids))) needs "
                "them: return token_ids from /v1/chat/completions")
        drift = measure_drift(call_index, self.last_prompt, self.last_output, prompt, self.eot, self._decode)
        n = len(prompt) - (len(self.last_prompt) + len(self.last_output))
        if n < 0:
            detail = ""
            if drift is not None:
                detail = (f"; the {drift.region} re-renders differently from token {drift.at} on "
                          f"(held {drift.held_text[:80]!r}, rendered {drift.rendered_text[:80]!r})")
            raise MaskCountError(
                "negative_count", f"response_mask count is {n}: the chat template renders the messages to "
                f"{len(prompt)} tokens, fewer than the {len(self.last_prompt)} + {len(self.last_output)} the "
                f"trainer holds{detail}. Keep the rendered history append-only, or give the mask with "
                "engine.set_next_response_mask(mask)")
        return n, drift

    def commit(self, prompt: list[int], output_ids: list[int] | None) -> None:
        """The call with this rendered prompt succeeded; `output_ids` are the answer's token_ids (None when
        the answer had none)."""
        self.last_prompt = prompt
        self.last_output = list(output_ids) if output_ids is not None else None

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))
