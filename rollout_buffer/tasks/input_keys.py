"""How one line of a run's input file becomes the `sample` a task sees: slime's dataset keys.

slime reads a prompt file with `--input-key` (the prompt: a string, or a list of chat messages when the
file is in chat form, as dapo-math-17k is), `--label-key`, `--metadata-key` and `--tool-key` (per-line tool
schemas, a list or that list as a JSON string). The adapter sends slime's values as `input_key`,
`label_key`, `metadata_key` and `tool_key` in `/start_rollout`; the runtime maps every line with them
before the task sees it, so a task reads the same fields whatever the file calls them.

The normalised sample is a copy of the line (every key kept, for task modules written against raw lines)
in which these fields are set, winning over a raw key of the same name:

    instance_id  str                      the line's id (see `rollout_buffer.tasks.input_file`)
    prompt       str | list[dict] | None  the value under input_key
    label        Any | None               the value under label_key
    metadata     dict                     the value under metadata_key, {} when absent
    tools        list[dict] | None        the value under tool_key (a JSON string is decoded)

When a key is not sent (clients other than the adapter): the prompt is the first of `prompt`, `messages`,
`question`, `input` that the line has; the label is `label`, else `answer` (also when `label_key` is
null, slime's default); metadata is `metadata`; tools are `tools`. A null `tool_key` reads no tools, as
slime does with `--tool-key` unset. The raw line stays available to native tasks as `ctx.line`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_buffer.tasks.contract import InvalidSample

PROMPT_KEYS: tuple[str, ...] = ("prompt", "messages", "question", "input")
LABEL_KEYS: tuple[str, ...] = ("label", "answer")
KEY_FIELDS: dict[str, str] = {"prompt": "input_key", "label": "label_key", "metadata": "metadata_key",
                              "tools": "tool_key"}
_UNSET = object()


class InputKeyError(ValueError):
    """A `/start_rollout` key setting that is not a usable name; `field` is the setting."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


def _key_setting(options: Mapping[str, Any], name: str) -> Any:
    """The setting as sent: a non-empty string, None (sent as null), or `_UNSET` (not sent)."""
    if name not in options:
        return _UNSET
    value = options[name]
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InputKeyError(name, f"must be a non-empty string naming a key of the input lines (got {value!r})")
    return value.strip()


@dataclass(frozen=True)
class InputKeys:
    """The line keys a run reads; None in `input_key`/`label_key` means: search the defaults."""

    input_key: str | None = None
    label_key: str | None = None
    metadata_key: str = "metadata"
    tool_key: str | None = "tools"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> InputKeys:
        """From `/start_rollout`'s extra fields; raises `InputKeyError` naming a bad setting."""
        values = {name: _key_setting(options, name) for name in KEY_FIELDS.values()}
        metadata = values["metadata_key"]
        tools = values["tool_key"]
        return cls(
            input_key=None if values["input_key"] in (None, _UNSET) else values["input_key"],
            label_key=None if values["label_key"] in (None, _UNSET) else values["label_key"],
            metadata_key="metadata" if metadata in (None, _UNSET) else metadata,
            tool_key="tools" if tools is _UNSET else tools,
        )

    def source_of(self, field_name: str, line: Mapping[str, Any] | None = None) -> str:
        """The line key a normalised field comes from, for error messages ("'question' (input_key)")."""
        setting = KEY_FIELDS.get(field_name)
        if setting is None:
            return repr(field_name)
        key = getattr(self, setting)
        if key is None and field_name in ("prompt", "label"):
            candidates = PROMPT_KEYS if field_name == "prompt" else LABEL_KEYS
            found = next((k for k in candidates if line is not None and k in line), None)
            return repr(found) if found else "/".join(repr(k) for k in candidates) + " (none given, none found)"
        return f"{key!r} ({setting})"


def _first(line: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in line:
            return line[key]
    return None


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise InvalidSample("tools", f"a string that is not JSON ({exc})") from exc
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise InvalidSample("tools", f"expected a list of tool schemas (objects), got {type(value).__name__}")
    return value or None


def normalise(line: Mapping[str, Any], keys: InputKeys) -> dict[str, Any]:
    """The sample a task sees for `line` (see the module docstring); raises `InvalidSample` naming the field
    when metadata or tools have the wrong shape. Prompt and label are checked by the task's own
    `validate_sample`, since what a task needs differs."""
    sample = dict(line)
    sample["prompt"] = line.get(keys.input_key) if keys.input_key else _first(line, PROMPT_KEYS)
    sample["label"] = line.get(keys.label_key) if keys.label_key else _first(line, LABEL_KEYS)
    metadata = line.get(keys.metadata_key)
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidSample("metadata", f"expected an object, got {type(metadata).__name__}")
    sample["metadata"] = metadata or {}
    sample["tools"] = _tools(line.get(keys.tool_key)) if keys.tool_key else None
    return sample


def prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    """A normalised prompt as chat messages: a string becomes one user message; a message list is copied."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        return [dict(m) for m in prompt if isinstance(m, dict)]
    return []


def check_prompt(prompt: Any) -> None:
    """Raise `InvalidSample("prompt", ...)` unless the prompt is non-empty text or a list of chat messages
    (objects with a string `role` and a string or list `content`), as slime's `--input-key` allows."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidSample("prompt", "is empty")
        return
    if prompt is None:
        raise InvalidSample("prompt", "missing")
    if not isinstance(prompt, list):
        raise InvalidSample("prompt", f"expected text or a list of chat messages, got {type(prompt).__name__}")
    if not prompt:
        raise InvalidSample("prompt", "is an empty message list")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidSample("prompt", f"message {i} is not an object with a string 'role'")
        if not isinstance(message.get("content"), (str, list)) and not message.get("tool_calls"):
            raise InvalidSample("prompt", f"message {i} ({message['role']}) has no string or list 'content'")
