"""The `response_mask` of each call to a trainer-hosted engine: how many prompt tokens are new and not the
model's.

The trainer keeps its own token list per rollout: the first prompt, then each call's sampled ids. On a later
call it must append the tokens the history gained that the model did not sample (template glue, tool
results, user turns); the buffer tells it how many, as `[0] * n`. With the same tokenizer and chat template:

    n = len(render(new messages, add_generation_prompt=True))
        - len(previous prompt) - len(previous completion as the template renders it)

The previous prompt must be a token prefix of the new render, and the previous completion ends at the first
end-of-turn token after it (inclusive when the model sampled that token itself, i.e. it was not cut short).
Anything else means the rendered history was rewritten and `HistoryRewriteError` is raised: the count is
never guessed.
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.remote.token_fix import end_of_turn_id
from rollout_buffer.task_contract import HistoryRewriteError


class ResponseMaskTracker:
    """Remembers the previous call's rendered prompt; counts what each new call adds."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eot = end_of_turn_id(tokenizer)
        self.previous_prompt: list[int] | None = None
        self.previous_closed = True

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def new_tokens(self, prompt: list[int]) -> int:
        """How many tokens of `prompt` follow the previous prompt and the previous completion."""
        previous = self.previous_prompt
        if previous is None:
            raise RuntimeError("new_tokens() before the first call was committed")
        if prompt[:len(previous)] != previous:
            at = next((i for i, (a, b) in enumerate(zip(previous, prompt)) if a != b), min(len(previous), len(prompt)))
            raise HistoryRewriteError(
                f"the chat template renders the earlier conversation differently now (first difference at "
                f"token {at} of the {len(previous)}-token previous prompt): the new tokens cannot be counted "
                "exactly; keep history append-only or give the mask with engine.set_next_response_mask(mask)")
        try:
            end = prompt.index(self.eot, len(previous))
        except ValueError:
            raise HistoryRewriteError("the new prompt has no end-of-turn token after the previous prompt: the "
                                      "previous assistant turn is missing from the history") from None
        return len(prompt) - (end + 1 if self.previous_closed else end)

    def commit(self, prompt: list[int], closed: bool) -> None:
        """The call with this rendered prompt succeeded; `closed` = the model sampled its end-of-turn token."""
        self.previous_prompt = list(prompt)
        self.previous_closed = closed
