"""mini-swe-agent (PyPI) for the tests: installed once into its own virtual environment under the tools
cache (its dependencies, litellm and datasets among them, stay out of the project's), and run from there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.claude_code import cache_root

MINI_SWE_AGENT_VERSION = "2.4.6"


def _works(python: Path, version: str) -> bool:
    check = f"import importlib.metadata as m; assert m.version('mini-swe-agent') == {version!r}"
    try:
        return subprocess.run([str(python), "-c", check], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def install_mini_swe_agent(version: str = MINI_SWE_AGENT_VERSION) -> Path:
    """The Python of a virtual environment holding mini-swe-agent `version`, made on first use;
    RuntimeError when it cannot be installed."""
    home = cache_root() / f"mini-swe-agent-{version}"
    python = home / "bin" / "python"
    if _works(python, version):
        return python
    steps = [[sys.executable, "-m", "venv", str(home)],
             [str(python), "-m", "pip", "install", "-q", f"mini-swe-agent=={version}"]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"installing mini-swe-agent {version} failed: {done.stderr[-2000:]}")
    if not _works(python, version):
        raise RuntimeError(f"mini-swe-agent {version} does not import after its install in {home}")
    return python
