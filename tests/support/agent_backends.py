"""Sandbox backends the agent_command tests name by module path: the local backend failing like
infrastructure does (once per rollout, or always)."""

from pathlib import Path
from typing import Any

from rollout_buffer.agents.local import LocalSandbox
from rollout_buffer.agents.sandbox import Limits


def flaky_once(*, name: str, limits: Limits, options: dict[str, Any]) -> LocalSandbox:
    """Fails the first sandbox of each rollout (by name), then works."""
    marker = Path(options.pop("markers")) / name
    if not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        raise OSError("sandbox host unreachable (injected)")
    return LocalSandbox(name=name, limits=limits, options=options)


def always_down(*, name: str, limits: Limits, options: dict[str, Any]) -> LocalSandbox:
    """Never works; appends one line per try to `options["calls"]`."""
    with open(options["calls"], "a") as fh:
        fh.write(name + "\n")
    raise OSError("sandbox host unreachable (injected)")
