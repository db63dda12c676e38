"""Secrets kept out of every log line: the dashboard's `?token=` and the write key of capability URLs.

The token authenticates as the query parameter whose *decoded* name is `token` (`?%74oken=` and
`?to%6Ben=` included: the middleware decodes names as `parse_qsl` does), so the value of every parameter
whose name decodes to `token` is replaced, whatever the spelling. A capability URL carries a run's write key
as the path segment after `/cap/` (`auth.CAPABILITY_PATH`); that segment is replaced too, also when the
separators or the word are percent-encoded, as an HTTP client logging the URL it called would write it.

Redaction happens when a record is made (a log record factory), so it covers uvicorn's access log, the
`httpx` and `urllib3` lines of a task module that posts from the server's own threads, and handlers added
later, at every level.
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import Any
from urllib.parse import unquote_plus

REDACTED = "<redacted>"
TOKEN_PARAMETER = "token"

_QUERY = re.compile(r"\?[^\s\"'#]*")
_QUERY_SEPARATOR = re.compile(r"([?&])")
_SLASH = r"(?:/|%2f)"
_CAPABILITY_SEGMENT = re.compile(rf"({_SLASH}(?:c|%63)(?:a|%61)(?:p|%70){_SLASH})(?:(?!%2f)[^/?#\s\"'])+",
                                 re.IGNORECASE)
_SCALARS = (int, float, bool, type(None))


def _redact_query(match: re.Match[str]) -> str:
    """The query with the value of each parameter named `token` (once decoded, in any case: `?TOKEN=` does
    not authenticate, but a mistyped name still carries the secret) replaced. A `?` that is part of the path
    counts as a separator too, so no parameter hides behind one."""
    parts = _QUERY_SEPARATOR.split(match.group(0))
    for i in range(0, len(parts), 2):
        name, equals, _ = parts[i].partition("=")
        if equals and unquote_plus(name).lower() == TOKEN_PARAMETER:
            parts[i] = f"{name}={REDACTED}"
    return "".join(parts)


def redact(text: str) -> str:
    """`text` with token query values and capability keys replaced by `<redacted>` (idempotent: a redacted
    text comes back unchanged, so a record is never redacted twice over)."""
    if "?" in text:
        text = _QUERY.sub(_redact_query, text)
    return _CAPABILITY_SEGMENT.sub(rf"\1{REDACTED}", text)


def _redact_arg(value: Any) -> Any:
    """A format argument, redacted when its text holds a secret; numbers stay numbers (`%d` needs them)."""
    if isinstance(value, _SCALARS):
        return value
    text = value if isinstance(value, str) else str(value)
    clean = redact(text)
    return value if clean == text else clean


def redact_record(record: logging.LogRecord) -> None:
    """Redact a record in place: its arguments one by one (uvicorn's access formatter reads them as a
    tuple), then the whole message in case a secret spans the template and an argument, then the
    traceback's text."""
    if isinstance(record.args, tuple):
        record.args = tuple(_redact_arg(a) for a in record.args)
    elif isinstance(record.args, dict):
        record.args = {k: _redact_arg(v) for k, v in record.args.items()}
    try:
        message = record.getMessage()
    except Exception:  # a malformed call: the handler reports it, as it would without redaction
        return
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and not record.exc_text:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if redact(text) != text:
            record.exc_text = redact(text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


def install_redaction() -> None:
    """Make every log record of this process pass through `redact_record`; calling it again adds nothing."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "redacts_secrets", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        redact_record(record)
        return record

    factory.redacts_secrets = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
