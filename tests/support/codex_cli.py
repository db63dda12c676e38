"""Codex CLI for the tests: `@openai/codex` (a Node launcher and its native binary, the platform package)
installed from the npm registry once per version into the tool cache (`tests.support.claude_code`'s), reused
after. npm missing is an error, not a skip, as for Claude Code."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support.claude_code import cache_root

CODEX_VERSION = "0.171.0"
PACKAGE = "@openai/codex"


def _works(binary: Path) -> bool:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60,
                             env={"PATH": os.environ.get("PATH", ""), "HOME": tempfile.gettempdir()})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and CODEX_VERSION in out.stdout


def install_codex(version: str = CODEX_VERSION) -> Path:
    """The `codex` launcher of `version`, installing it with npm on first use; RuntimeError when it cannot."""
    root = cache_root()
    target = root / f"codex-{version}"
    binary = target / "node_modules" / ".bin" / "codex"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".codex.lock", "w") as lock:  # one installer at a time (xdist workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists() and _works(binary):
            return binary
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError(f"npm is not installed: the Codex CLI test needs Node.js and npm to install {PACKAGE} "
                               "(Debian: apt-get install nodejs npm; .ci/run does this)")
        staging = Path(tempfile.mkdtemp(prefix="codex-", dir=root))
        done = subprocess.run([npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund",
                               f"{PACKAGE}@{version}"], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(f"npm install {PACKAGE}@{version} failed ({done.returncode}): {done.stderr[-3000:]}")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        if not _works(binary):
            raise RuntimeError(f"{binary} does not run after installing {PACKAGE}@{version}")
        return binary


def provider_config(base_url: str, env_key: str, *, model: str = "policy") -> str:
    """`~/.codex/config.toml` with nothing but a custom Responses provider: Codex's defaults otherwise (its
    default tools, `web_search` and the `multi_agent_v1` namespace included)."""
    return (f'model = "{model}"\nmodel_provider = "rollout_buffer"\n\n'
            f'[model_providers.rollout_buffer]\nname = "rollout-buffer gateway"\nbase_url = "{base_url}"\n'
            f'env_key = "{env_key}"\nwire_api = "responses"\n')
