"""On-policy token fix for chat-completion trajectories.

An OpenAI-style server that returns per-call token ids (`prompt_token_ids` and `token_ids`, as vLLM's
`return_token_ids` and newer SGLang do) tells us exactly what the model saw and sampled on each call. Its
next prompt, however, re-renders the whole history from messages, and the model's own ids for an earlier
assistant turn do not always survive that: BPE merges differ after decode -> encode, tool calls are
re-templated from parsed JSON. Training on the re-rendered ids would train on tokens the model never
sampled. So each later prompt is aligned with what we already hold, turn by turn:

* context tokens we hold (the first prompt, template glue, tool and user turns) must reappear exactly;
* for each earlier assistant turn, the re-rendered span is found by counting end-of-turn tokens
  (`<|im_end|>`); when its ids differ but it says the same thing, the model's ids are spliced back in and
  the template's tokens from the end-of-turn token on are kept;
* when the history is not monotonic (truncated, summarised, reasoning stripped from earlier turns by the
  template), no splice can be right: the trajectory is split and the call starts a new segment.

Everything here is a pure function of the recorded calls and the tokenizer; `TokenFixCounters` counts
each case so drift is visible.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.chat_format import strip_end_markers

_EOT_TOKEN = "<|im_end|>"
_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_SPACE_AROUND_TAG_RE = re.compile(r"\s*(" + "|".join(re.escape(t) for t in _TAGS) + r")\s*")


def end_of_turn_id(tokenizer: Any) -> int:
    """The token the chat template closes every turn with: `<|im_end|>` for ChatML, else EOS."""
    token_id = tokenizer.convert_tokens_to_ids(_EOT_TOKEN)
    if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id >= 0:
        return token_id
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has neither <|im_end|> nor an EOS token; cannot find turn ends")
    return int(tokenizer.eos_token_id)


@dataclass
class TokenFixCounters:
    """How each later turn was joined: reused as is, spliced, or split off into a new segment."""

    calls: int = 0
    exact: int = 0  # a later call whose prompt re-rendered every earlier assistant turn to the model's ids
    spliced: int = 0  # a later call where some turn re-rendered differently but equivalently: ids put back
    split: int = 0  # a later call whose history was not monotonic: a new segment was started
    split_reasons: Counter[str] = field(default_factory=Counter)

    def add(self, other: TokenFixCounters) -> None:
        self.calls += other.calls
        self.exact += other.exact
        self.spliced += other.spliced
        self.split += other.split
        self.split_reasons.update(other.split_reasons)

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "exact": self.exact, "spliced": self.spliced, "split": self.split,
                "split_reasons": dict(self.split_reasons)}


# Process-wide totals, for metrics; `build_segments` always adds to them (and to counters it is given).
TOTALS = TokenFixCounters()


def _canonical_call(match: re.Match[str]) -> str:
    body = match.group(1).strip()
    try:
        call = json.loads(body)
        if isinstance(call, dict) and isinstance(call.get("arguments"), str):
            call["arguments"] = json.loads(call["arguments"])
    except ValueError:
        return match.group(0)
    return "<tool_call>" + json.dumps(call, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "</tool_call>"


def normalize_turn_text(text: str) -> str:
    """What a re-rendering may change without changing meaning: whitespace at the turn's ends and around
    think/tool-call tags, the end-of-turn marker, and the JSON spelling of tool calls."""
    text = strip_end_markers(text)
    text = _TOOL_CALL_RE.sub(_canonical_call, text)
    text = _SPACE_AROUND_TAG_RE.sub(r"\1", text)
    return text.strip()


def same_turn(tokenizer: Any, model_ids: list[int], rendered_ids: list[int]) -> bool:
    """True when the template's re-rendering of an assistant turn says what the model sampled."""
    decode = tokenizer.decode
    return normalize_turn_text(decode(model_ids, skip_special_tokens=False)) == normalize_turn_text(
        decode(rendered_ids, skip_special_tokens=False))


@dataclass
class _Part:
    ids: list[int]
    model: bool
    logprobs: list[float] | None = None


@dataclass
class _Open:
    """The segment being built: its parts and the recorded calls it covers."""

    parts: list[_Part]
    calls: list[int]
    weight_versions: list[Any]
    finish_reason: str | None


def _align(parts: list[_Part], prompt: list[int], eot: int, tokenizer: Any) -> tuple[int, bool] | str:
    """(where `prompt` continues past what `parts` hold, whether a splice was needed), or why it does
    not continue them (a split reason)."""
    cursor = 0
    spliced = False
    for part in parts:
        if not part.model:
            if prompt[cursor:cursor + len(part.ids)] != part.ids:
                return "truncated" if len(prompt) < cursor + len(part.ids) else "context_changed"
            cursor += len(part.ids)
            continue
        try:
            end = prompt.index(eot, cursor) + 1
        except ValueError:
            return "truncated"
        closed = bool(part.ids) and part.ids[-1] == eot
        rendered = prompt[cursor:end] if closed else prompt[cursor:end - 1]
        if rendered != part.ids:
            if not same_turn(tokenizer, part.ids, rendered):
                return "assistant_rewritten"
            spliced = True
        # An unclosed model turn (cut by length) leaves the template's end-of-turn token to the context.
        cursor = end if closed else end - 1
    return cursor, spliced


def _close(segment: _Open) -> dict[str, Any]:
    prompt = segment.parts[0].ids
    response_ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] | None = []
    for part in segment.parts[1:]:
        response_ids.extend(part.ids)
        mask.extend([1 if part.model else 0] * len(part.ids))
        if logprobs is not None:
            if part.model and part.logprobs is None:
                logprobs = None
            else:
                logprobs.extend(part.logprobs if part.model and part.logprobs is not None else [0.0] * len(part.ids))
    return {"prompt_ids": list(prompt), "response_ids": response_ids, "response_mask": mask,
            "response_logprobs": logprobs, "calls": list(segment.calls),
            "weight_versions": list(segment.weight_versions), "finish_reason": segment.finish_reason}


def _check_call(index: int, call: dict[str, Any]) -> tuple[list[int], list[int], list[float] | None]:
    prompt, output = call.get("prompt_ids"), call.get("output_ids")
    if not isinstance(prompt, list) or not prompt or not isinstance(output, list):
        raise ValueError(f"calls[{index}] needs prompt_ids (non-empty) and output_ids lists")
    logprobs = call.get("output_logprobs")
    if logprobs is not None and len(logprobs) not in (0, len(output)):
        raise ValueError(f"calls[{index}] has {len(logprobs)} output_logprobs for {len(output)} output_ids")
    return list(prompt), list(output), (list(logprobs) if logprobs else None)


def build_segments(calls: list[dict[str, Any]], tokenizer: Any, *,
                   counters: TokenFixCounters | None = None) -> list[dict[str, Any]]:
    """Turn recorded calls (`{prompt_ids, output_ids, output_logprobs?, finish_reason?, weight_version?}`,
    in call order) into token-exact training segments.

    Each segment is `{prompt_ids, response_ids, response_mask, response_logprobs, calls, weight_versions,
    finish_reason}`: mask 1 marks the model's own sampled ids, 0 the template, tool and user tokens;
    `response_logprobs` is None when a call carried no logprobs (never guessed), else 0.0 on mask-0
    tokens. `len(response_ids) == len(response_mask)` (== len(response_logprobs) when present).
    """
    local = TokenFixCounters()
    eot = end_of_turn_id(tokenizer)
    segments: list[dict[str, Any]] = []
    current: _Open | None = None
    for index, call in enumerate(calls):
        prompt, output, logprobs = _check_call(index, call)
        local.calls += 1
        if current is not None:
            where = _align(current.parts, prompt, eot, tokenizer)
            if not isinstance(where, str):
                cursor, spliced = where
                local.spliced += spliced
                local.exact += not spliced
                tail = prompt[cursor:]
                if tail:
                    current.parts.append(_Part(tail, model=False))
                current.parts.append(_Part(output, model=True, logprobs=logprobs))
                current.calls.append(index)
                current.weight_versions.append(call.get("weight_version"))
                current.finish_reason = call.get("finish_reason")
                continue
            local.split += 1
            local.split_reasons[where] += 1
            segments.append(_close(current))
        current = _Open(parts=[_Part(prompt, model=False), _Part(output, model=True, logprobs=logprobs)],
                        calls=[index], weight_versions=[call.get("weight_version")],
                        finish_reason=call.get("finish_reason"))
    if current is not None:
        segments.append(_close(current))
    TOTALS.add(local)
    if counters is not None:
        counters.add(local)
    return segments
