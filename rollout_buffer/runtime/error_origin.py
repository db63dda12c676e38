"""Where a task's exception came from: the file and line of the task's code it was raised in (or raised
through), so a failure record and the log say `KeyError: 'nope' (at my_generator.py:12, in rollout)` instead
of a bare `'nope'` that leaves the author guessing which lookup failed."""

from __future__ import annotations

import os
import sysconfig
import traceback
from pathlib import Path

_RUNTIME = str(Path(__file__).resolve().parent)  # the machinery that calls the task, not the task
_LIBRARIES = tuple({os.path.realpath(p) for p in (sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))})


def _is_task_code(filename: str) -> bool:
    path = os.path.realpath(filename)
    return not (path.startswith(_RUNTIME + os.sep) or path.startswith(_LIBRARIES) or filename.startswith("<"))


def origin(error: BaseException) -> str | None:
    """`path:line, in function` of the innermost frame of task code in the error's traceback (a library it
    called may have raised: the task's line that called it is the one to fix); None when there is none."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ is not None else []
    for frame in reversed(frames):
        if _is_task_code(frame.filename):
            return f"{frame.filename}:{frame.lineno}, in {frame.name}"
    return None
