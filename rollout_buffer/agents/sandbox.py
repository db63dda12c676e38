"""The sandbox contract: where an agent command and its verifier run, one fresh sandbox per rollout.

A backend is any object with these four coroutines (`Sandbox`); `open_sandbox` builds one from a factory
named by module path (`"pkg.module:factory"`, called as `factory(name=..., limits=..., options=...)`), the
built-in `local` backend by default (`rollout_buffer.agents.local`). The contract every backend keeps:

* `exec(argv, timeout_s=, env=, cwd=)` runs a command to its end or its deadline and returns an `ExecResult`
  (exit code, bounded stdout/stderr tails, timed_out, duration). The environment is exactly `env` plus the
  backend's own minimum (PATH, HOME, TMPDIR, LANG): nothing of the server's. At the deadline the command
  and everything it started is killed; the call then returns (it never raises for the command's failure).
* `write_file(path, data)` / `read_file(path)`: paths relative to the sandbox's work folder (`~/` for its
  home); a path that leaves the sandbox raises `SandboxError`.
* `cleanup()` kills whatever still runs and removes the sandbox; safe to call twice, and called on cancel.
* Infrastructure failures (cannot create the sandbox, the backend is unreachable) raise `SandboxError`:
  the agent task retries those once; an agent's own failure is an `ExecResult`, never an exception.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

DEFAULT_BACKEND = "rollout_buffer.agents.local:LocalSandbox"


class SandboxError(RuntimeError):
    """An infrastructure failure of the sandbox (not the agent's)."""


@dataclass(frozen=True)
class Limits:
    """Per-command resource limits (None: no limit). `output_bytes` bounds what is kept of stdout/stderr."""

    cpu_s: int | None = 600
    memory_bytes: int | None = 8 << 30
    open_files: int | None = 1024
    file_size_bytes: int | None = 1 << 30
    output_bytes: int = 1 << 20

    @classmethod
    def from_options(cls, raw: dict[str, Any] | None) -> "Limits":
        raw = dict(raw or {})
        unknown = set(raw) - {"cpu_s", "memory_mb", "open_files", "file_size_mb", "output_kb"}
        if unknown:
            raise ValueError(f"unknown limit(s) {sorted(unknown)}")
        values: dict[str, Any] = {}
        for name, key, scale in (("cpu_s", "cpu_s", 1), ("memory_mb", "memory_bytes", 1 << 20),
                                 ("open_files", "open_files", 1), ("file_size_mb", "file_size_bytes", 1 << 20),
                                 ("output_kb", "output_bytes", 1 << 10)):
            if name in raw:
                value = raw[name]
                if value is None and key != "output_bytes":
                    values[key] = None
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} must be an integer >= 1 (or null), got {value!r}")
                values[key] = value * scale
        return cls(**values)


@dataclass
class ExecResult:
    """How a command ended, with bounded tails of its output."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_s: float = 0.0
    output_bytes: int = 0  # all bytes it wrote to stdout and stderr, kept or not
    truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@runtime_checkable
class Sandbox(Protocol):
    async def exec(self, argv: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
                   cwd: str | None = None) -> ExecResult: ...

    async def write_file(self, path: str, data: str | bytes) -> None: ...

    async def read_file(self, path: str) -> bytes: ...

    async def cleanup(self) -> None: ...


def load_factory(path: str) -> Any:
    """`"pkg.module:attr"` -> the attribute; ValueError naming what is wrong."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"a sandbox backend is named 'package.module:factory', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import sandbox backend module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{path!r}: {attr!r} is not a callable in {module_name}")
    return factory


async def open_sandbox(backend: str | None, *, name: str, limits: Limits,
                       options: dict[str, Any] | None = None) -> Sandbox:
    """A fresh sandbox from the backend's factory (sync or async); SandboxError when it cannot be made."""
    factory = load_factory(backend or DEFAULT_BACKEND)
    try:
        made = factory(name=name, limits=limits, options=dict(options or {}))
        if hasattr(made, "__await__"):
            made = await made
    except SandboxError:
        raise
    except Exception as exc:  # noqa: BLE001 - any backend failure to create is infrastructure
        raise SandboxError(f"cannot create a sandbox: {type(exc).__name__}: {exc}") from exc
    return made
