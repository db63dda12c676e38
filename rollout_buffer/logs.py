"""Logging set-up for the command line: one format, and no third-party notice that does not apply here.

`transformers` logs "PyTorch was not found. Models won't be available ..." at import when torch is
absent. The buffer only ever uses its tokenizers, which need no torch, so on a clean machine that line is
noise that every process (and the demo) would print first; it is dropped, and only it.
"""

from __future__ import annotations

import logging
import re

TORCH_NOTICE = "PyTorch was not found."


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


_QUERY_TOKEN = re.compile(r"([?&]token=)[^&\s]*")


class _RedactQueryToken(logging.Filter):
    """Replaces the value of a `token` query parameter (the dashboard's `/?token=`) in uvicorn's access log
    lines, so the secret never reaches a log file."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_QUERY_TOKEN.sub(r"\1<redacted>", a) if isinstance(a, str) else a
                                for a in record.args)
        return True


def redact_query_tokens() -> None:
    """Install the redaction on uvicorn's access logger; calling it again adds nothing."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _RedactQueryToken) for f in logger.filters):
        logger.addFilter(_RedactQueryToken())


def configure_logging(level: str) -> None:
    """The root logger's level and format for `serve` and `worker`."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
