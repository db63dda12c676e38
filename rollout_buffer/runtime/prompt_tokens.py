"""Token-exact prompts for multi-turn rollouts.

The first prompt is the chat template's rendering of the messages. Every later prompt is the previous
prompt + the model's own output ids + the tokens of only the newly appended messages, so a turn's prompt
always extends the previous one exactly and re-tokenizing the model's output can never drift.

The new messages' tokens are the template's own text for them: the conversation is rendered with the last
assistant message replaced by a sentinel, and everything after the sentinel (the template's end of the
assistant turn, the new messages, the generation prompt) is tokenized. When the model's output already
ends with the turn-closing token the template writes (`<|im_end|>` for ChatML), that token is not repeated.
"""

from __future__ import annotations

import functools
from typing import Any

from rollout_buffer.task_contract import HistoryRewriteError

SENTINEL = "\u2063<rollout-buffer-assistant-sentinel>\u2063"


@functools.lru_cache(maxsize=32)
def added_token_texts(tokenizer: Any) -> dict[int, str]:
    """id -> text of the tokenizer's added tokens (the turn-closing tokens are among them); once per tokenizer."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): str(getattr(token, "content", token)) for i, token in decoder.items()}


class PromptTokens:
    """Renders and tokenizes one rollout's conversation with one tokenizer and tool list."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self._added = added_token_texts(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_encode = getattr(backend, "encode", None)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        if self._backend_encode is not None:  # the same ids as tokenizer.encode, without its Python overhead
            return list(self._backend_encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def continuation_text(self, before_assistant: list[dict[str, Any]], new_messages: list[dict[str, Any]],
                          last_output_ids: list[int]) -> str:
        """The template's text after the model's last output, through the new messages and generation prompt."""
        stub = {"role": "assistant", "content": SENTINEL}
        full = self.render([*before_assistant, stub, *new_messages], add_generation_prompt=True)
        at = full.find(SENTINEL)
        if at < 0 or full.find(SENTINEL, at + 1) >= 0:
            raise HistoryRewriteError("the chat template does not render assistant content verbatim exactly once; "
                                      "token-exact continuation is impossible with it")
        glue = full[at + len(SENTINEL):]
        if last_output_ids:
            content = self._added.get(last_output_ids[-1])
            if content and glue.startswith(content):
                glue = glue[len(content):]
        return glue

    def extend(self, previous_prompt: list[int], previous_output: list[int],
               before_assistant: list[dict[str, Any]], new_messages: list[dict[str, Any]]) -> list[int]:
        """The next prompt: previous prompt + output + the new messages' tokens (an exact extension by construction)."""
        tail = self.encode(self.continuation_text(before_assistant, new_messages, previous_output))
        if not tail:
            raise HistoryRewriteError("the new messages render to no tokens; nothing to continue from")
        return [*previous_prompt, *previous_output, *tail]
