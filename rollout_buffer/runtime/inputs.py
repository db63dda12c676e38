"""Reading a run's `input_file`: one JSON object per line, each with a unique `instance_id`.

Ids missing from a line are assigned from the line number, so a restarted run (or another machine reading
the same file) assigns the same ids. A bad file is refused whole, naming the line, before anything is
enqueued: a half-enqueued run would be worse than none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from rollout_buffer.runs import StartRolloutError


def _line_error(path: str | Path, number: int, message: str) -> StartRolloutError:
    return StartRolloutError("input_file", f"{path} line {number}: {message}")


def _parse_line(path: str | Path, number: int, raw: bytes, seen: dict[str, int]) -> dict[str, Any]:
    try:
        sample = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _line_error(path, number, f"not valid JSON ({exc})") from exc
    if not isinstance(sample, dict):
        raise _line_error(path, number, f"expected a JSON object, got {type(sample).__name__}")
    instance_id = sample.get("instance_id")
    if instance_id is None:
        instance_id = str(number - 1)
    elif isinstance(instance_id, bool) or not isinstance(instance_id, (str, int)):
        raise _line_error(path, number, "instance_id must be a string or an integer")
    instance_id = str(instance_id)
    if not instance_id:
        raise _line_error(path, number, "instance_id is empty")
    if instance_id in seen:
        raise _line_error(path, number, f"duplicate instance_id {instance_id!r} (first on line {seen[instance_id]})")
    seen[instance_id] = number
    sample["instance_id"] = instance_id
    return sample


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """Every non-blank line as a dict with a text `instance_id` (assigned as `str(line_number - 1)` if absent)."""
    samples: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    try:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                if raw.strip():
                    samples.append(_parse_line(path, number, raw, seen))
    except OSError as exc:
        raise StartRolloutError("input_file", f"{path!r} is not readable: {exc.strerror}") from exc
    return samples
