"""The lean `/buffer/write` path (`rollout_buffer.api.fast_write`): it serves exactly the routes' URLs, with
the routes' answers, and leaves every other request to the framework. The refusals of `/buffer/write`
itself are tested in test_core_api.py (they go through this path too)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from rollout_buffer.api.fast_write import pinned_run
from tests.support.helpers import ServerSpec, make_record, start_run, write_jsonl

SERVER = ServerSpec(args=("--task-dir", str(Path(__file__).parents[1] / "fixtures" / "tasks")))


@pytest.mark.parametrize("path, expected", [
    ("/buffer/write", None),
    ("/runs/r-1/buffer/write", "r-1"),
    ("/runs/a b/buffer/write", "a b"),
    ("/runs//buffer/write", False),
    ("/runs/a/b/buffer/write", False),
    ("/buffer/write/", False),
    ("/buffer/write_batch", False),
    ("/x/buffer/write", False),
])
def test_only_the_write_urls_are_taken(path: str, expected: str | None | bool) -> None:
    assert pinned_run(path) == expected


def test_pinned_url_writes_and_refuses_like_the_route(client: httpx.Client, tmp_path: Path) -> None:
    input_file = write_jsonl(tmp_path / "in.jsonl", [{"instance_id": "i0"}])
    run_id = start_run(client, input_file, task_type="external", run_id=f"t-{uuid.uuid4().hex[:10]}", repeats=2)
    record = make_record("i0", uid="u-pinned")
    answer = client.post(f"/runs/{run_id}/buffer/write", json=record)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    assert answer.json() == {"success": True, "message": "stored", "data": {
        "uid": "u-pinned", "run_id": run_id, "outcome": "stored", "group_completed": False}}
    again = client.post(f"/runs/{run_id}/buffer/write", json=record).json()
    assert again["message"] == "already stored (duplicate uid)" and again["data"]["outcome"] == "duplicate"
    other = client.post(f"/runs/{run_id}/buffer/write", json={**make_record("i0"), "run_id": "elsewhere"})
    assert other.status_code == 422 and other.json() == {
        "success": False, "message": f"record names run 'elsewhere', the URL names run {run_id!r}"}
    missing = client.post("/runs/no-such-run/buffer/write", json=make_record("i0"))
    assert missing.status_code == 404 and missing.json()["message"] == "unknown run_id 'no-such-run'"
    bad = client.post(f"/runs/{run_id}/buffer/write", json={**make_record("i0"), "reward": "high"})
    assert bad.status_code == 422 and "reward" in bad.json()["message"] and bad.json()["errors"][0]["field"] == "reward"
    assert client.get(f"/runs/{run_id}").json()["records"]["written"] == 1, "one record stored, once"


def test_other_methods_and_urls_reach_the_framework(client: httpx.Client) -> None:
    assert client.get("/buffer/write").status_code == 405
    assert client.put("/runs/r/buffer/write", json={}).status_code == 405
    assert client.post("/buffer/write/", json={}).status_code in (307, 404)  # not the write route
