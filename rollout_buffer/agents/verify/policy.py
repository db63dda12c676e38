"""A run's `agent.verify` option: the verification mode, the failure reward and the reward's range.

    "agent": {"verify": "clean"}                      # or "snapshot", "same"
    "agent": {"verify": {"mode": "clean",             # the default for every task
                         "tasks": {"db-task": "snapshot"},   # a task's own mode (tasks check --solutions says)
                         "failure_reward": 0.0,       # the reward of a kept failure (a finite number)
                         "reward_range": [0, 1],      # a reward outside it is a kept failure (reward_invalid)
                         "outputs": ["/srv/out"],     # absolute paths copied into a clean container too
                         "keep_work": true,           # the archive keeps what clean mode's tests saw (reverify)
                         "python_safe_path": {"cancel-async-tasks": false}}}  # or false: Harbor's sys.path

The mode, the task modes and the outputs are for Harbor tasks (docker). The range falls back to the task's
`[verifier] reward_range` (task.toml), then to [0, 1]; a run's own verifiers (`tests_pass`, `command`,
`python`) are held to the run's range when it declares one. The failure reward is every failure record's.

`python_safe_path` (default true: `PYTHONSAFEPATH=1` in test.sh's environment, so no `python3 -m pytest` or
`python3 script.py` puts the agent's work folder first on `sys.path`) may be turned off for the run (`false`) or
for named tasks (`{"task": false}`): Harbor's own semantics, for a task whose tests run a script of the work
folder that imports its siblings. Such tests run the agent's code as root anyway (`agents/verify/lint.py`), so
the variable protects nothing there; `tasks check --solutions` says which tasks score 1 only without it.
"""

from __future__ import annotations

import math
import posixpath
from dataclasses import dataclass, field
from typing import Any

MODES = ("clean", "snapshot", "same")
DEFAULT_MODE = "clean"
DEFAULT_RANGE = (0.0, 1.0)
MAX_OUTPUTS = 32
_KEYS = {"mode", "tasks", "failure_reward", "reward_range", "outputs", "reward_key", "reward_weights", "keep_work",
         "python_safe_path"}


class PolicyError(ValueError):
    """A bad `agent.verify` option: `field` (dotted, under `agent.verify`) and why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class VerifyPolicy:
    mode: str = DEFAULT_MODE
    tasks: dict[str, str] = field(default_factory=dict)
    failure_reward: float = 0.0
    reward_range: tuple[float, float] | None = None
    outputs: tuple[str, ...] = ()
    # a reward.json of several named rewards (Harbor's multi-metric form): the one the trainer gets, or weights
    reward_key: str | None = None
    reward_weights: dict[str, float] | None = None
    keep_work: bool = False  # a run with an archive keeps each rollout's work products (agents/verify/keep.py)
    safe_path: bool = True  # PYTHONSAFEPATH=1 for test.sh (module docstring)
    safe_path_tasks: dict[str, bool] = field(default_factory=dict)  # a task's own choice

    def mode_for(self, task: str) -> str:
        return self.tasks.get(task, self.mode)

    def safe_path_for(self, task: str) -> bool:
        return self.safe_path_tasks.get(task, self.safe_path)


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def reward_range(value: Any, where: str) -> tuple[float, float]:
    """`[low, high]` (finite, low < high) -> a tuple; PolicyError naming `where` otherwise."""
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_finite(v) for v in value) \
            or not value[0] < value[1]:
        raise PolicyError(where, f"must be [low, high] with finite numbers, low < high, got {value!r}")
    return float(value[0]), float(value[1])


def output_paths(value: Any, where: str) -> tuple[str, ...]:
    """Absolute, normalized paths other than `/` (at most MAX_OUTPUTS)."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_OUTPUTS:
        raise PolicyError(where, f"must be a list of at most {MAX_OUTPUTS} absolute paths")
    paths = []
    for item in value:
        if not isinstance(item, str) or not item.startswith("/") or "\0" in item \
                or posixpath.normpath(item) in ("/", "//"):
            raise PolicyError(where, f"each output must be an absolute path other than '/', got {item!r}")
        paths.append(posixpath.normpath(item))
    return tuple(paths)


def parse_policy(raw: Any) -> VerifyPolicy:
    """The run's `agent.verify` -> VerifyPolicy; PolicyError naming the field."""
    if raw is None:
        return VerifyPolicy()
    if isinstance(raw, str):
        raw = {"mode": raw}
    if not isinstance(raw, dict):
        raise PolicyError("agent.verify", f"must be a mode ({', '.join(MODES)}) or an object, got {raw!r}")
    unknown = set(raw) - _KEYS
    if unknown:
        raise PolicyError("agent.verify", f"unknown option(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
    mode = raw.get("mode", DEFAULT_MODE)
    if mode not in MODES:
        raise PolicyError("agent.verify.mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
    tasks = raw.get("tasks") or {}
    if not isinstance(tasks, dict) or not all(isinstance(k, str) and v in MODES for k, v in tasks.items()):
        raise PolicyError("agent.verify.tasks", f"must be an object of task name: mode ({', '.join(MODES)})")
    failure = raw.get("failure_reward", 0.0)
    if not _finite(failure):
        raise PolicyError("agent.verify.failure_reward", f"must be a finite number, got {failure!r}")
    bounds = raw.get("reward_range")
    bounds = None if bounds is None else reward_range(bounds, "agent.verify.reward_range")
    if bounds is not None and not bounds[0] <= failure <= bounds[1]:
        raise PolicyError("agent.verify.failure_reward", f"{failure!r} is outside reward_range {list(bounds)}")
    outputs = output_paths(raw.get("outputs") or [], "agent.verify.outputs")
    key, weights = raw.get("reward_key"), raw.get("reward_weights")
    if key is not None and (not isinstance(key, str) or not key):
        raise PolicyError("agent.verify.reward_key", f"must be a key of reward.json, got {key!r}")
    if weights is not None and (not isinstance(weights, dict) or not weights or not all(
            isinstance(k, str) and _finite(v) for k, v in weights.items())):
        raise PolicyError("agent.verify.reward_weights", f"must be an object of key: finite weight, got {weights!r}")
    if key is not None and weights is not None:
        raise PolicyError("agent.verify.reward_key", "give reward_key or reward_weights, not both")
    keep = raw.get("keep_work", False)
    if not isinstance(keep, bool):
        raise PolicyError("agent.verify.keep_work", f"must be true or false, got {keep!r}")
    safe = raw.get("python_safe_path", True)
    if not isinstance(safe, bool) and not (isinstance(safe, dict) and all(
            isinstance(k, str) and isinstance(v, bool) for k, v in safe.items())):
        raise PolicyError("agent.verify.python_safe_path", f"must be true, false or an object of task name: true or "
                                                           f"false, got {safe!r}")
    return VerifyPolicy(mode=mode, tasks=dict(tasks), failure_reward=float(failure), reward_range=bounds,
                        outputs=outputs, reward_key=key, keep_work=keep,
                        safe_path=safe if isinstance(safe, bool) else True,
                        safe_path_tasks={} if isinstance(safe, bool) else dict(safe),
                        reward_weights={k: float(v) for k, v in weights.items()} if weights else None)
