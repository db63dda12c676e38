"""The environment test.sh runs with, the same in every mode: nothing of the agent's, nothing it can plant.

`env -i`, then the image's own variables (its config, the task author's: the agent cannot change them), then:
`PATH` the image's with every entry under the work folder, /tmp, /var/tmp, /dev/shm or /home dropped (the
system's when the image sets none), `HOME=/root`, `PYTHONSAFEPATH=1` (Python never puts the working folder or
the script's folder first on `sys.path`, so an agent's `pytest.py` or `json.py` in /app shadows nothing),
`PYTHONNOUSERSITE=1` (no user site folder; `PYTHONSAFEPATH` is left out where the run turns
`agent.verify.python_safe_path` off for the task, Harbor's own semantics), and last the task's `[verifier] env` (the task author's choice,
which may override any of these). The working folder is the image's (Harbor's: /app by default); test.sh's
own `cd` is honoured.
"""

from __future__ import annotations

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_AGENT_PLACES = ("/tmp", "/var/tmp", "/dev/shm", "/home")


def _under(path: str, places: tuple[str, ...]) -> bool:
    path = path.rstrip("/") or "/"
    return any(path == place or path.startswith(place + "/") for place in places)


def system_path(image_path: str | None, work: str) -> str:
    """The image's PATH less the places the agent could write (its work folder, temp folders, homes)."""
    places = (work.rstrip("/"), *_AGENT_PLACES)
    kept = [p for p in (image_path or SYSTEM_PATH).split(":") if p.startswith("/") and not _under(p, places)]
    return ":".join(kept) or SYSTEM_PATH


def verifier_env(image_env: list[str], *, work: str, task_env: dict[str, str] | None = None,
                 safe_path: bool = True) -> dict[str, str]:
    """The variables of test.sh (module docstring), in order."""
    env: dict[str, str] = {}
    for item in image_env:
        name, sep, value = item.partition("=")
        if sep and name:
            env[name] = value
    env.update(PATH=system_path(env.get("PATH"), work), HOME="/root", PYTHONNOUSERSITE="1")
    if safe_path:  # else as in Harbor: the image's own setting, if any
        env["PYTHONSAFEPATH"] = "1"
    env.update(task_env or {})
    return env


def env_argv(env: dict[str, str]) -> list[str]:
    """`env -i NAME=value ...`: the command prefix that runs with exactly these variables."""
    return ["env", "-i", *(f"{name}={value}" for name, value in env.items())]
