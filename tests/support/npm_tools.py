"""Agent CLIs from the npm registry for the tests (Claude Code, Codex CLI): installed once per package and
version into a cache folder (`ROLLOUT_BUFFER_TOOL_CACHE`, default `~/.cache/rollout-buffer/tools`), reused
after. npm missing is an error, not a skip: CI (`.ci/run`) installs nodejs and npm from Debian when absent."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support.sandbox_python import world_readable


def cache_root() -> Path:
    return Path(os.environ.get("ROLLOUT_BUFFER_TOOL_CACHE") or Path.home() / ".cache" / "rollout-buffer" / "tools")


def _works(binary: Path, version: str) -> bool:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60,
                             env={"PATH": os.environ.get("PATH", ""), "HOME": tempfile.gettempdir()})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and version in out.stdout


def install_npm_tool(package: str, version: str, *, folder: str, binary_name: str) -> Path:
    """`<cache>/<folder>/node_modules/.bin/<binary_name>` of `package@version`, installed with npm on first use
    (one installer at a time across test processes); RuntimeError when it cannot be."""
    root = cache_root()
    target = root / folder
    binary = target / "node_modules" / ".bin" / binary_name
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists() and _works(binary, version):
            return binary
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError(f"npm is not installed: the tests need Node.js and npm to install {package} "
                               "(Debian: apt-get install nodejs npm; .ci/run does this)")
        staging = Path(tempfile.mkdtemp(prefix=f"{folder}-", dir=root))
        done = subprocess.run([npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund",
                               f"{package}@{version}"], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(f"npm install {package}@{version} failed ({done.returncode}): {done.stderr[-3000:]}")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        if not _works(binary, version):
            raise RuntimeError(f"{binary} does not run after installing {package}@{version}")
        return binary


def readable_by_any_uid(install: Path) -> Path:
    """`install` (a tool's install folder) where any uid can read it: itself when every folder above it is
    world-readable, else a hard-linked copy in the temp dir (a bwrap sandbox runs as a uid of its own)."""
    if world_readable(install):
        return install
    target = Path(tempfile.gettempdir()) / "rollout-buffer-tools-readable" / install.name
    target.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(target.parent, 0o755)
    with open(target.parent / f".{install.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            staging = Path(tempfile.mkdtemp(prefix=f"{install.name}-", dir=target.parent))
            copied = subprocess.run(["cp", "-al", f"{install}/.", str(staging)], capture_output=True, text=True)
            if copied.returncode != 0:  # another filesystem: a plain copy
                shutil.rmtree(staging, ignore_errors=True)
                shutil.copytree(install, staging, symlinks=True)
            os.chmod(staging, 0o755)
            staging.rename(target)
    return target
