"""Strict request bodies: a field the server does not know is refused (400) with the closest known name,
instead of being silently ignored (a misspelled `num_repeats_per_sample` once made a run of groups of one).

Fields that slime's or a peer's client is known to send and this server does not read are accepted and
dropped (`ACCEPTED_UNREAD` of each body), so those clients keep working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

UNKNOWN_FIELD = "unknown_field"


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name `name` is most likely a misspelling of, if any is close."""
    matches = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_field_message(name: str, known: Iterable[str]) -> str:
    """`unknown field 'x'`, with `(did you mean y?)` when a known name is close."""
    guess = closest(name, known)
    hint = f" (did you mean {guess}?)" if guess else ""
    return f"unknown field {name!r}{hint}"


def unknown_field_error(names: list[str], known: Iterable[str]) -> PydanticCustomError:
    """The validation error the app answers 400 (see `rollout_buffer.api.errors`)."""
    known = list(known)
    text = "; ".join(unknown_field_message(n, known) for n in names)
    return PydanticCustomError(UNKNOWN_FIELD, "{text}", {"text": text, "field": names[0]})


class StrictBody(BaseModel):
    """A request body that refuses unknown fields (400 naming each, with the closest known one)."""

    model_config = ConfigDict(extra="forbid")
    ACCEPTED_UNREAD: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = {info.alias or name for name, info in cls.model_fields.items()}
        unknown = [n for n in data if n not in known and n not in cls.ACCEPTED_UNREAD]
        if unknown:
            raise unknown_field_error(unknown, known)
        if cls.ACCEPTED_UNREAD & data.keys():
            return {k: v for k, v in data.items() if k not in cls.ACCEPTED_UNREAD}
        return data
