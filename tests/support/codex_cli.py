"""Codex CLI for the tests: `@openai/codex` (a Node launcher and its native binary, the platform package) from
the npm registry, cached (`tests.support.npm_tools`)."""

from __future__ import annotations

from pathlib import Path

from tests.support.npm_tools import install_npm_tool

CODEX_VERSION = "0.171.0"
PACKAGE = "@openai/codex"


def install_codex(version: str = CODEX_VERSION) -> Path:
    """The `codex` launcher of `version`, installing it with npm on first use; RuntimeError when it cannot."""
    return install_npm_tool(PACKAGE, version, folder=f"codex-{version}", binary_name="codex")


def provider_config(base_url: str, env_key: str, *, model: str = "policy") -> str:
    """`~/.codex/config.toml` with nothing but a custom Responses provider: Codex's defaults otherwise (its
    default tools, `web_search` and the `multi_agent_v1` namespace included)."""
    return (f'model = "{model}"\nmodel_provider = "rollout_buffer"\n\n'
            f'[model_providers.rollout_buffer]\nname = "rollout-buffer gateway"\nbase_url = "{base_url}"\n'
            f'env_key = "{env_key}"\nwire_api = "responses"\n')
