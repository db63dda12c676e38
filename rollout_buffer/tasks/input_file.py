"""Reading a run's `input_file`: one JSON object per line, each with a unique `instance_id`.

Ids missing from a line are assigned from the line number (`str(line_number - 1)`), so a restarted run (or
another machine reading the same file) assigns the same ids; integer ids (common in slime's data files)
become their decimal text. Blank lines are skipped but still counted, so line numbers in errors are the
editor's. A bad line raises `InputFileError` naming it; callers refuse the whole file, since a
half-enqueued run would be worse than none.

This module depends on nothing else in the package, so both the API's start checks (`rollout_buffer.runs.lifecycle`)
and the runtime (`rollout_buffer.runtime.inputs`) can use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson


class InputFileError(ValueError):
    """A line (or the file) that cannot be read; `line` is 1-based, 0 for the file as a whole."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path} line {line}: {message}" if line else f"{path!r} {message}")
        self.path = str(path)
        self.line = line
        self.reason = message


def parse_line(path: str | Path, number: int, raw: bytes, seen: dict[str, int]) -> dict[str, Any]:
    """One JSON object with a text `instance_id`; `seen` maps the ids so far to their line numbers."""
    try:
        sample = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InputFileError(path, number, f"not valid JSON ({exc})") from exc
    if not isinstance(sample, dict):
        raise InputFileError(path, number, f"expected a JSON object, got {type(sample).__name__}")
    instance_id = sample.get("instance_id")
    if instance_id is None:
        instance_id = str(number - 1)
    elif isinstance(instance_id, bool) or not isinstance(instance_id, (str, int)):
        raise InputFileError(path, number, "instance_id must be a string or an integer")
    instance_id = str(instance_id)
    if not instance_id:
        raise InputFileError(path, number, "instance_id is empty")
    if instance_id in seen:
        raise InputFileError(path, number, f"duplicate instance_id {instance_id!r} (first on line {seen[instance_id]})")
    seen[instance_id] = number
    sample["instance_id"] = instance_id
    return sample


def iter_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, parsed line) for every non-blank line, checked as `parse_line` checks it."""
    seen: dict[str, int] = {}
    try:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                if raw.strip():
                    yield number, parse_line(path, number, raw, seen)
    except OSError as exc:
        raise InputFileError(path, 0, f"is not readable: {exc.strerror}") from exc
