"""SGLang's output rules, applied to a planned output: where it stops, and the text it reports.

Token ids are checked as SGLang checks them; the plan is walked token by token with SGLang's stop checks
(max_new_tokens, EOS and stop_token_ids, stop strings, ignore_eos); the text is detokenized with
skip_special_tokens and trimmed of the matched stop unless no_stop_trim. Kept apart from the scripted
policy so what is generated and how SGLang cuts it can be read (and changed) separately.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Any

from rollout_buffer.testing.engine.codec import Codec
from rollout_buffer.testing.engine.http_server import BadRequest
from rollout_buffer.testing.engine.policy import Plan

# SGLang's default when a /generate request gives no max_new_tokens.
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class Result:
    """One finished (or cut) generation."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    text: str
    prompt_ids: list[int]
    rid: str


def check_token_ids(prompt_ids: list[Any], vocab_size: int) -> None:
    """Refuse anything but in-vocabulary integer ids (as SGLang does); C-speed unless something is wrong."""
    if not prompt_ids:
        return
    try:
        array.array("q", prompt_ids)  # TypeError for a float, string or null; OverflowError for a huge number
        valid = min(prompt_ids) >= 0 and max(prompt_ids) < vocab_size
    except (TypeError, OverflowError):
        valid = False
    if not valid:  # name the first bad id
        for token in prompt_ids:
            if not isinstance(token, int) or not 0 <= token < vocab_size:
                raise BadRequest(f"input_ids contains an invalid token id: {token!r}")


def finish(plan: Plan, params: dict[str, Any], default_max: int, stop_ids: set[int],
           codec: Codec) -> tuple[int, dict[str, Any]]:
    """Walk the plan token by token with SGLang's stop checks; return (count, reason)."""
    max_new = params.get("max_new_tokens")
    max_new = default_max if max_new is None else int(max_new)
    ignore_eos = bool(params.get("ignore_eos", False))
    stop_ids = set() if ignore_eos else set(stop_ids)
    stop_ids.update(int(i) for i in params.get("stop_token_ids") or [])
    stops = params.get("stop") or []
    if isinstance(stops, str):
        stops = [stops]
    skip_special = bool(params.get("skip_special_tokens", True))
    if max_new <= 0:
        return 0, {"type": "length", "length": 0}
    for count in range(1, len(plan.ids) + 1):
        if count >= max_new:
            return count, {"type": "length", "length": max_new}
        token = plan.ids[count - 1]
        if token in stop_ids:
            return count, {"type": "stop", "matched": token}
        if stops:
            text = codec.decode(plan.ids[:count], skip_special_tokens=skip_special)
            for stop in stops:
                if stop and stop in text:
                    return count, {"type": "stop", "matched": stop}
    return len(plan.ids), {"type": "length", "length": max_new}


def output_text(ids: list[int], reason: dict[str, Any], params: dict[str, Any], codec: Codec) -> str:
    """Detokenize like SGLang: trim a matched stop token or string unless no_stop_trim."""
    skip_special = bool(params.get("skip_special_tokens", True))
    trim = not params.get("no_stop_trim", False)
    matched = reason.get("matched")
    if trim and isinstance(matched, int) and ids:
        ids = ids[:-1]
    text = codec.decode(ids, skip_special_tokens=skip_special)
    if trim and isinstance(matched, str):
        pos = text.find(matched)
        if pos >= 0:
            text = text[:pos]
    return text
