"""tools/assign_instance_id.py run as a user runs it: a subprocess on real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from tests.support.helpers import REPO

TOOL = REPO / "tools" / "assign_instance_id.py"


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=60)


def read(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def test_assigns_stable_unique_ids_and_keeps_existing(tmp_path: Path) -> None:
    source = tmp_path / "data.jsonl"
    source.write_text('{"q": "a"}\n{"q": "b", "instance_id": "keep-me"}\n\n{"q": "a"}\n{"q": "c"}\n')
    result = run_tool("--input_path", str(source), "--prefix", "math-")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "data_instance_id.jsonl"
    rows = read(out)
    ids = [r["instance_id"] for r in rows]
    assert ids[1] == "keep-me" and len(set(ids)) == 4
    assert all(i.startswith("math-") for i in ids if i != "keep-me")
    assert ids[0] != ids[2], "identical records still get distinct ids"
    again = tmp_path / "again.jsonl"
    assert run_tool("--input_path", str(source), "--output_path", str(again), "--prefix", "math-").returncode == 0
    assert [r["instance_id"] for r in read(again)] == ids, "ids are stable across runs"


def test_refuses_duplicates_and_bad_lines_without_writing(tmp_path: Path) -> None:
    source = tmp_path / "dup.jsonl"
    source.write_text('{"instance_id": "x"}\n{"instance_id": "x"}\n')
    result = run_tool("--input_path", str(source))
    assert result.returncode == 1 and "duplicate instance_id 'x' on lines 1 and 2" in result.stderr
    assert not (tmp_path / "dup_instance_id.jsonl").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n{oops\n')
    result = run_tool("--input_path", str(bad))
    assert result.returncode == 1 and "line 2 is not valid JSON" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "dup.jsonl"], "no temp files left"
