"""mini-swe-agent (PyPI) for the tests: installed once into its own virtual environment under the tools
cache (its dependencies, litellm and datasets among them, stay out of the project's), and run from there; or,
for a task's container, into a virtual environment of the system Python that any uid can read."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rollout_buffer.testing.engine.answers import MINI_SUBMIT
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


SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's: the docker tests' base image has the same Python at this path


def install_mini_swe_agent_for_sandbox(version: str = MINI_SWE_AGENT_VERSION) -> Path:
    """An install folder of mini-swe-agent `version` that a task's container can run from a read-only mount:
    a virtual environment made by the system Python (so its `bin/python` and the `mini` script's shebang lead
    to `/usr/bin/python3`, which the container has too) under the temp dir, where any uid reads it (the
    documented `python3 -m venv DIR && DIR/bin/pip install mini-swe-agent`); made once, RuntimeError when it
    cannot be."""
    home = Path(tempfile.gettempdir()) / "rollout-buffer-tools-readable" / f"mini-swe-agent-{version}-system"
    home.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(home.parent, 0o755)
    python = home / "bin" / "python"
    with open(home.parent / f".{home.name}.lock", "w") as lock:  # one installer at a time (xdist workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _works(python, version):
            return home
        shutil.rmtree(home, ignore_errors=True)
        steps = [[SYSTEM_PYTHON, "-m", "venv", str(home)],
                 [str(python), "-m", "pip", "install", "-q", f"mini-swe-agent=={version}"]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(f"installing mini-swe-agent {version} with {SYSTEM_PYTHON} failed "
                                   f"(Debian: apt-get install python3-venv): {done.stderr[-2000:]}")
        if not _works(python, version):
            raise RuntimeError(f"mini-swe-agent {version} does not import after its install in {home}")
        os.chmod(home, 0o755)
    return home


def config_with_plain_task(install: Path) -> dict:
    """mini-swe-agent's own default config (`mini.yaml` of the install, read by its Python) with a short
    instance template: the default's workflow text holds `lines 1-10` after the task, which the test engine
    (answering the prompt's last arithmetic expression) would compute in place of the task's question."""
    script = ("import json, yaml; from minisweagent.config import builtin_config_dir as d; "
              "print(json.dumps(yaml.safe_load((d / 'mini.yaml').read_text())))")
    done = subprocess.run([str(install / "bin" / "python"), "-c", script], capture_output=True, text=True,
                          timeout=120, env={"PATH": os.defpath, "MSWEA_SILENT_STARTUP": "1",
                                            "MSWEA_GLOBAL_CONFIG_DIR": tempfile.gettempdir()})
    if done.returncode != 0:
        raise RuntimeError(f"cannot read mini-swe-agent's mini.yaml: {done.stderr[-2000:]}")
    config = json.loads(done.stdout)
    config["agent"]["instance_template"] = ("Please solve this issue: {{task}}\n\nUse the bash tool; when done, "
                                            f"run `echo {MINI_SUBMIT}` alone.\n")
    return config
