"""A `--task-dir` module whose TASK_TYPE is a built-in's replaces the built-in (slime's own generator example
declares `"math"`): one log line says which module is active, `GET /tasks` shows it and where it came from,
and runs of that type are rolled out by it. Two `--task-dir` modules of one type stay fatal."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rollout_buffer.tasks.discovery import BUILTIN_DIR, TaskRegistryError, discover
from tests.support.helpers import ServerProcess, start_run, write_jsonl
from tests.support.process_tools import wait_for

# A legacy (slime-style) module of the built-in type "math" that writes one record naming itself.
OVERRIDE = '''
import httpx

TASK_TYPE = "math"


def run_rollout(data):
    record = {"uid": "u-" + data["run_id"], "instance_id": "i0", "reward": 0.5,
              "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
              "extra_info": {"written_by": "user math module"}}
    httpx.post(data["remote_buffer_url"].rstrip("/") + "/buffer/write", json=record, timeout=30).raise_for_status()
'''


def _folder(tmp_path: Path, name: str = "mine") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "base_generator.py").write_text(OVERRIDE)
    return folder


def test_a_task_dir_module_replaces_the_builtin_of_its_type(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    builtin = discover()
    registry = discover([folder])
    math = registry.get("math")
    assert math is not None and math.path == folder / "base_generator.py" and math.kind == "legacy"
    assert math.source == "task-dir" and math.overrides == BUILTIN_DIR / "math_generator.py"
    assert set(registry.overrides) == {"math"} and builtin.overrides == {}
    assert registry.get("calculator").source == "builtin", "other built-ins stay"  # type: ignore[union-attr]
    [line] = registry.override_lines()
    assert str(folder / "base_generator.py") in line and "overrides the built-in" in line
    listed = registry.describe()["tasks"]["math"]
    assert listed["source"] == "task-dir" and listed["overrides"] == str(BUILTIN_DIR / "math_generator.py")
    assert "overrides" not in registry.describe()["tasks"]["calculator"]


def test_two_task_dir_modules_of_one_type_are_still_refused(tmp_path: Path) -> None:
    with pytest.raises(TaskRegistryError, match="'math' is defined by both"):
        discover([_folder(tmp_path, "a"), _folder(tmp_path, "b")])


def test_the_server_runs_the_override_and_says_so_once(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    rows = write_jsonl(tmp_path / "in.jsonl", [{"instance_id": "i0", "prompt": "1+1?", "label": "2"}])
    server = ServerProcess(tmp_path / "data", "--task-dir", str(folder))
    with server, httpx.Client(base_url=server.url, timeout=30) as client:
        listed = client.get("/tasks").json()["tasks"]["math"]
        assert listed["path"] == str(folder / "base_generator.py") and listed["source"] == "task-dir"
        assert listed["overrides"].endswith("math_generator.py")
        run_id = start_run(client, rows, repeats=1, remote_buffer_url=server.url)
        records: list[dict] = []

        def read() -> bool:
            answer = client.post("/get_rollout_data", json={"run_id": run_id, "wait_s": 1.0}).json()
            records.extend(answer["data"]["data"] if answer["success"] else [])
            return bool(records)

        wait_for(read, timeout_s=30, what="the override module's record")
        assert records[0]["extra_info"]["written_by"] == "user math module"
    log = server.log_path.read_text()
    assert log.count("overrides the built-in") == 1, log[-2000:]
