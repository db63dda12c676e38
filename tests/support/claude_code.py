"""Claude Code for the tests: `@anthropic-ai/claude-code` from the npm registry, cached (`tests.support.npm_tools`)."""

from __future__ import annotations

from pathlib import Path

from tests.support.npm_tools import cache_root, install_npm_tool, readable_by_any_uid

CLAUDE_CODE_VERSION = "2.1.197"
PACKAGE = "@anthropic-ai/claude-code"
__all__ = ["CLAUDE_CODE_VERSION", "cache_root", "install_claude_code", "readable_by_any_uid"]


def install_claude_code(version: str = CLAUDE_CODE_VERSION) -> Path:
    """The `claude` binary of `version`, installing it with npm on first use; RuntimeError when it cannot."""
    return install_npm_tool(PACKAGE, version, folder=f"claude-code-{version}", binary_name="claude")
