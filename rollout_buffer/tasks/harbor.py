"""Harbor task folders read as input lines: the format's parsing, and nothing else.

A Harbor task is a folder: `instruction.md` (the prompt), `task.toml` (`[agent] timeout_sec`, `[verifier]
timeout_sec` and `env`, `[environment] docker_image` or an `environment/Dockerfile`, `cpus`, `memory_mb`,
`storage_mb`, `build_timeout_sec`, free `[metadata]`), `environment/`, `tests/test.sh` (the verifier) and
`solution/` (never shown to the agent). A run's `input_file` may name a folder of such folders (each one an
instance, `instance_id` = its name; folders whose name starts with `.` are skipped), or be a JSONL file whose
lines name task folders with `"task_dir"` (relative to the JSONL file's folder and inside it).

Each task becomes one sample: `prompt` = the instruction, `harbor` = the parsed task (its real folder, the
timeouts, the env of the agent, the verifier and the solution, the image or the environment's content hash, the
limits, and the warnings of what task.toml asks for that is not honoured here), `metadata` = its `[metadata]`.
What each task.toml field becomes, and the bounds of every number: `rollout_buffer.tasks.harbor_toml`; no link
out of the task folder: `rollout_buffer.tasks.harbor_links`. The sample is small: the tests are read from the
folder when the verifier runs, never stored. A bad task raises `HarborTaskError` naming the task and every
problem found, each with its field or path.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from pathlib import Path
from typing import Any

from rollout_buffer.tasks.harbor_compose import MAIN, ComposeError, read_compose
from rollout_buffer.tasks.harbor_links import check_links
from rollout_buffer.tasks.harbor_toml import Note, Notes, TaskLimits, parse_config

MAX_INSTRUCTION_BYTES = 1 << 20
MAX_TOML_BYTES = 1 << 20
MAX_ENV_FILES = 10_000
MAX_ENV_BYTES = 256 << 20  # an environment/ folder larger than this is refused (it is sent to the Engine)
MAX_LISTED_PROBLEMS = 20  # in one refusal's message (`rollout-buffer tasks check` lists them all)


class HarborTaskError(ValueError):
    """A task folder that cannot be used: `task` (its name), `field` (e.g. `task.toml [verifier] timeout_sec`)
    and `reason` of its first problem, and `problems`, all of them (each a `Note`)."""

    def __init__(self, task: str, field: str, reason: str, problems: list[Note] | None = None) -> None:
        self.problems = problems or [Note(field, reason)]
        listed = "; ".join(str(p) for p in self.problems[:MAX_LISTED_PROBLEMS])
        more = len(self.problems) - MAX_LISTED_PROBLEMS
        super().__init__(f"task {task!r}: {listed}" + (f"; and {more} more problem(s)" if more > 0 else ""))
        self.task, self.field, self.reason = task, field, reason
        self.warnings: list[Note] = []  # what else reading the task found (`tasks check` lists them too)

    @classmethod
    def of(cls, task: str, problems: list[Note], warnings: list[Note] | None = None) -> HarborTaskError:
        error = cls(task, problems[0].field, problems[0].message, problems)
        error.warnings = list(warnings or [])
        return error


def is_task_dir(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "instruction.md").is_file()


def dataset_entries(dataset: str | Path) -> list[tuple[Path, HarborTaskError | None]]:
    """Every task folder of a dataset folder by name (a folder that is itself a task is its only task), each with
    its refusal when it is a link leading out of the dataset folder (its files would not be under the server's
    input roots)."""
    root = Path(dataset).resolve()
    if is_task_dir(root):
        return [(root, None)]
    found = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise HarborTaskError(root.name, "folder", "holds no task folder (each with instruction.md and task.toml)")
    return [(folder, None if root in folder.resolve().parents else
             HarborTaskError(folder.name, "folder", f"is a link to {str(folder.resolve())!r}, which leads out of "
                                                    "the dataset folder")) for folder in found]


def task_dirs(dataset: str | Path) -> list[Path]:
    """The task folders of a dataset folder (`dataset_entries`); the first link out of it is refused."""
    entries = dataset_entries(dataset)
    for _, outside in entries:
        if outside is not None:
            raise outside
    return [folder for folder, _ in entries]


def environment_hash(env_dir: Path, task: str = "") -> str:
    """A digest of every file under `environment/` (paths, modes and bytes): the built image's tag, so an
    edited environment builds anew and an unchanged one is built once."""
    digest = hashlib.sha256()
    count = size = 0
    for path in sorted(p for p in env_dir.rglob("*") if p.is_file() or p.is_symlink()):
        count += 1
        rel = path.relative_to(env_dir).as_posix()
        digest.update(rel.encode() + b"\0")
        if path.is_symlink():
            digest.update(b"link:" + os.readlink(path).encode() + b"\0")
            continue
        size += path.stat().st_size
        if count > MAX_ENV_FILES or size > MAX_ENV_BYTES:
            raise HarborTaskError(task, "environment/", f"more than {MAX_ENV_FILES} files or {MAX_ENV_BYTES >> 20} MB")
        digest.update(oct(path.stat().st_mode & 0o777).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _instruction(root: Path, notes: Notes) -> str | None:
    try:
        with open(root / "instruction.md", "rb") as handle:
            instruction = handle.read(MAX_INSTRUCTION_BYTES + 1)
    except OSError as exc:
        notes.refuse("instruction.md", f"missing or unreadable ({exc.strerror})")
        return None
    if len(instruction) > MAX_INSTRUCTION_BYTES:
        notes.refuse("instruction.md", f"larger than {MAX_INSTRUCTION_BYTES >> 10} KB")
        return None
    try:
        prompt = instruction.decode()
    except UnicodeDecodeError:
        notes.refuse("instruction.md", "is not UTF-8 text")
        return None
    if not prompt.strip():
        notes.refuse("instruction.md", "is empty")
        return None
    return prompt


def _config(root: Path, notes: Notes) -> dict[str, Any] | None:
    try:
        with open(root / "task.toml", "rb") as handle:
            raw = handle.read(MAX_TOML_BYTES + 1)
    except OSError as exc:
        notes.refuse("task.toml", f"missing or unreadable ({exc.strerror})")
        return None
    if len(raw) > MAX_TOML_BYTES:
        notes.refuse("task.toml", f"larger than {MAX_TOML_BYTES >> 10} KB")
        return None
    try:
        return tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        notes.refuse("task.toml", f"is not valid TOML: {exc}")
        return None


def _compose_check(root: Path, notes: Notes) -> None:
    """A multi-container task's compose overlay: what cannot run faithfully is refused, what is left out named."""
    try:
        plan = read_compose(root / "environment", {"MAIN_IMAGE_NAME": "main", "CONTEXT_DIR": str(root / "environment")})
    except ComposeError as exc:
        notes.refuse(f"environment/docker-compose.yaml {exc.where}".rstrip(), exc.reason)
        return
    for where in (plan.ignored if plan is not None else []):
        if not where.startswith(f"services.{MAIN}.") or where.split(".")[-1] not in ("image", "build"):
            notes.warn(f"environment/docker-compose.yaml {where}", "left out here: the group shares one loopback "
                                                                     "and publishes nothing")


def _entrypoint_check(root: Path, notes: Notes) -> None:
    """Harbor starts the agent's container with its image's ENTRYPOINT (its compose command, `sleep infinity`,
    becomes the entrypoint's arguments); here the sandbox runs its own, so what an ENTRYPOINT of the Dockerfile's
    final stage sets up (a server, /etc/hosts entries) is absent: reported, never silent."""
    try:
        lines = (root / "environment" / "Dockerfile").read_text(errors="replace").splitlines()
    except OSError:
        return
    stages = [i for i, line in enumerate(lines) if line.lstrip().upper().startswith("FROM ")]
    final = lines[stages[-1] if stages else 0:]
    if any(line.lstrip().upper().startswith("ENTRYPOINT") for line in final):
        notes.warn("environment/Dockerfile ENTRYPOINT", "not run here: the agent's container runs the sandbox's "
                                                        "own entrypoint, so what the image's would start or set up "
                                                        "(a server, /etc/hosts entries) is absent")


def read_task(folder: str | Path, name: str | None = None, limits: TaskLimits | None = None,
              environ: dict[str, str] | None = None) -> dict[str, Any]:
    """One task folder -> its sample (`instance_id`, `prompt`, `harbor`, `metadata`); HarborTaskError naming
    every problem found (`problems`). `harbor["warnings"]` names what the task asks for that is not honoured
    here, and keys this reader does not know. `limits`: this server's bounds (default: this host's);
    `environ`: where `${VAR}` values are resolved (default: this process's environment)."""
    root = Path(folder).resolve()
    task = name or root.name
    if not root.is_dir():
        raise HarborTaskError(task, "folder", f"{str(folder)!r} is not a folder")
    notes = Notes()
    flagged = check_links(root, notes)
    prompt = None if "instruction.md" in flagged else _instruction(root, notes)
    config = None if "task.toml" in flagged else _config(root, notes)
    settings = parse_config(config or {}, limits or TaskLimits(), dict(os.environ) if environ is None else environ,
                            notes)
    env_hash = None
    if not settings["docker_image"] and "environment" not in flagged and config is not None:
        if not (root / "environment" / "Dockerfile").is_file():
            notes.refuse("task.toml [environment] docker_image",
                         "missing, and there is no environment/Dockerfile to build the image from")
        else:
            try:
                env_hash = environment_hash(root / "environment", task)
            except HarborTaskError as exc:
                notes.refuse(exc.field, exc.reason)
    if "tests" not in flagged and not (root / "tests" / "test.sh").is_file():
        notes.refuse("tests/test.sh", "missing (the verifier Harbor runs after the agent)")
    _compose_check(root, notes)
    if "environment" not in flagged:
        _entrypoint_check(root, notes)
    if notes.problems:
        raise HarborTaskError.of(task, notes.problems, notes.warnings)
    metadata = settings.pop("metadata")
    harbor = {"dir": str(root), "name": task, "env_hash": env_hash, **settings,
              "has_solution": "solution" not in flagged and (root / "solution" / "solve.sh").is_file(),
              "warnings": [str(note) for note in notes.warnings]}
    return {"instance_id": task, "prompt": prompt, "harbor": harbor, "metadata": metadata}


def named_task(jsonl: str | Path, task_dir: Any, task: str) -> Path:
    """A JSONL line's `task_dir`: a folder inside the JSONL file's own folder (never outside it)."""
    if not isinstance(task_dir, str) or not task_dir:
        raise HarborTaskError(task, "task_dir", "must be a folder path relative to the JSONL file")
    base = Path(jsonl).resolve().parent
    real = (base / task_dir).resolve()
    if real != base and base not in real.parents:
        raise HarborTaskError(task, "task_dir", f"{task_dir!r} leaves the JSONL file's folder")
    return real

