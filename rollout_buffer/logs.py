"""Logging set-up for the command line: one format, and no third-party notice that does not apply here.

`transformers` logs "PyTorch was not found. Models won't be available ..." at import when torch is
absent. The buffer only ever uses its tokenizers, which need no torch, so on a clean machine that line is
noise that every process (and the demo) would print first; it is dropped, and only it.

A client's words reach log lines as arguments (an instance id in a record's uid, a path): their control
characters are escaped (`\\r`, `\\n`, `\\x1b`, ...), so an id holding CR/LF cannot forge a line of its own.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from rollout_buffer.security.redaction import install_redaction

TORCH_NOTICE = "PyTorch was not found."
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """`text` with each control character written as its escape (`\\n`, `\\x1b`, `\\u2028`)."""
    return _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


def _escaped(value: Any) -> Any:
    return escape_controls(value) if isinstance(value, str) else value


def install_control_escaping() -> None:
    """Escape control characters in every log record's arguments (the template is the code's own);
    calling it again adds nothing."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "escapes_controls", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if isinstance(record.args, tuple):
            record.args = tuple(_escaped(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _escaped(v) for k, v in record.args.items()}
        return record

    factory.escapes_controls = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


class _DropTorchNotice(logging.Filter):
    """Drops the transformers no-torch notice; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TORCH_NOTICE)


def hide_torch_notice() -> None:
    """Install the filter on the `transformers` logger (it logs the notice there, before any handler runs).

    Call it before transformers is imported; calling it again adds nothing."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _DropTorchNotice) for f in logger.filters):
        logger.addFilter(_DropTorchNotice())


def configure_logging(level: str) -> None:
    """The root logger's level and format for `serve` and `worker`, with secrets redacted from every record
    (`rollout_buffer.security.redaction`): a task module's HTTP client logs the capability URL it posts to."""
    install_redaction()
    install_control_escaping()
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
