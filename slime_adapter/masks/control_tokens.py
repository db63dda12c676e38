"""Which added control tokens (`<|im_start|>`, ...) the message path can count and cut the rendering at:
those matched wherever they occur, and of those, the ones after which a cut leaves the tokenization unchanged
(the block cache of `loss_mask` relies on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["added_control_ids", "cut_tokens"]


def added_control_ids(tokenizer: Any, names: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """`(text, id)` of each control string that is an added token matched wherever it occurs."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, dict):
        return ()
    by_content = {getattr(tok, "content", str(tok)): (i, tok) for i, tok in decoder.items()}
    found = []
    for name in dict.fromkeys(names):
        hit = by_content.get(name)
        if hit is not None and not getattr(hit[1], "single_word", False):
            found.append((name, int(hit[0])))
    return tuple(found)


def cut_tokens(tokenizer: Any, control_ids: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    """Control tokens after which the text can be cut without changing its tokenization."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, dict):
        return ()
    contents = [getattr(tok, "content", str(tok)) for tok in decoder.values()]
    usable = []
    for name, token_id in control_ids:
        tok = decoder.get(token_id)
        if tok is None or any(getattr(tok, flag, True) for flag in ("lstrip", "rstrip", "normalized")):
            continue  # it could take whitespace from the other side, or match only after normalizing
        if any(name in other and other != name for other in contents):
            continue  # a longer added token could swallow it in the whole text
        usable.append(name)
    return tuple(usable)
