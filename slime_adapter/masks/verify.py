"""How much of the message path's tokenization is re-checked: the modes a generator and the
`agent_loss_mask_verify` setting accept (their meaning is in `loss_mask`'s docstring). Kept apart so the
settings can validate a mode without loading the generator.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["VERIFY_MODES", "VerifyMode", "verify_mode"]

VerifyMode = Literal["cheap", "full", "off"]
VERIFY_MODES: tuple[str, ...] = ("cheap", "full", "off")


def verify_mode(verify: bool | str | None) -> str:
    """`True` keeps its old meaning (the full re-render), `False`/`None` mean "off"."""
    if verify is True:
        return "full"
    if verify is False or verify is None:
        return "off"
    if verify in VERIFY_MODES:
        return str(verify)
    raise ValueError(f"verify must be one of {VERIFY_MODES} (or a bool), got {verify!r}")
