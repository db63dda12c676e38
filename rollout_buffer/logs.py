"""Logging set-up for the command line: one format, and no third-party notice that does not apply here.

`transformers` logs "PyTorch was not found. Models won't be available ..." at import when torch is
absent. The buffer only ever uses its tokenizers, which need no torch, so on a clean machine that line is
noise that every process (and the demo) would print first; it is dropped, and only it.
"""

from __future__ import annotations

import logging

from rollout_buffer.security.redaction import install_redaction

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


def configure_logging(level: str) -> None:
    """The root logger's level and format for `serve` and `worker`, with secrets redacted from every record
    (`rollout_buffer.security.redaction`): a task module's HTTP client logs the capability URL it posts to."""
    install_redaction()
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
