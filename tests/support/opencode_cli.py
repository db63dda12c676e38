"""OpenCode for the tests: `opencode-ai` (a launcher and its native binary, the platform package) from the npm
registry, cached (`tests.support.npm_tools`)."""

from __future__ import annotations

from pathlib import Path

from tests.support.npm_tools import install_npm_tool

OPENCODE_VERSION = "1.18.33"
PACKAGE = "opencode-ai"


def install_opencode(version: str = OPENCODE_VERSION) -> Path:
    """The `opencode` launcher of `version`, installing it with npm on first use; RuntimeError when it cannot."""
    return install_npm_tool(PACKAGE, version, folder=f"opencode-{version}", binary_name="opencode")
