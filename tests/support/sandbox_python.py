"""What an agent inside an isolated sandbox runs on: the system Python (`/usr/bin/python3`, mounted with `/usr`)
and a folder with the `openai` SDK that any uid can read (a sandbox's uid is not the server's), mounted
read-only. This environment's own site-packages when the system Python is the same minor version and every
folder above it is world-readable; else the SDK installed once with pip into the temp dir (same versions)."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path

SYSTEM_PYTHON = "/usr/bin/python3"


def world_readable(path: Path) -> bool:
    """Whether any uid can reach `path` (every folder above it searchable) and list or read it."""
    for part in [path, *path.parents]:
        mode = part.stat().st_mode
        if not mode & stat.S_IXOTH or (part == path and not mode & stat.S_IROTH):
            return False
    return True


def _system_minor() -> str:
    done = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                          text=True, timeout=30, check=True)
    return done.stdout.strip()


def agent_site_packages() -> Path:
    """A world-readable folder from which the system Python imports `openai` (RuntimeError when none can be made)."""
    if not Path(SYSTEM_PYTHON).exists():
        raise RuntimeError(f"{SYSTEM_PYTHON} is missing: the sandbox tests run agents on the system Python")
    if _system_minor() != str(tuple(sys.version_info[:2])):
        raise RuntimeError(f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}")
    own = Path(sysconfig.get_paths()["purelib"])
    if world_readable(own):
        return own
    target = Path(tempfile.gettempdir()) / f"rollout-buffer-agent-site-{metadata.version('openai')}"
    with open(f"{target}.lock", "w") as lock:  # one installer at a time (xdist workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "openai").is_dir():
            done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target),
                                   f"openai=={metadata.version('openai')}"], capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"pip install openai into {target} failed: {done.stderr[-2000:]}")
            for folder, dirs, files in os.walk(target):
                for name in [*dirs, *files]:
                    path = os.path.join(folder, name)
                    os.chmod(path, os.stat(path).st_mode | stat.S_IROTH | (stat.S_IXOTH if name in dirs else 0))
            os.chmod(target, 0o755)
    return target
