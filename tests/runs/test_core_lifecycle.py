"""Durability and multi-process behaviour: restarts, SIGKILL, two API processes on one Redis,
group timeouts, and task discovery errors. Each test runs its own server processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from tests.support.helpers import REPO, ServerProcess, make_record, start_run, write_jsonl
from tests.support.process_tools import sigint_default

TASKS = str(Path(__file__).parents[1] / "fixtures" / "tasks")


def _input(tmp_path: Path, n: int = 50) -> Path:
    return write_jsonl(tmp_path / "input.jsonl", [{"instance_id": f"i{i}"} for i in range(n)])


def _read_all(client: httpx.Client, run_id: str) -> list[dict]:
    records: list[dict] = []
    while True:
        answer = client.post("/get_rollout_data", json={"run_id": run_id}).json()
        if not answer["success"]:
            return records
        records.extend(answer["data"]["data"])


def test_write_without_active_run_is_409(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data", "--task-dir", TASKS) as server:
        response = httpx.post(f"{server.url}/buffer/write", json=make_record("i0"), timeout=30)
        assert response.status_code == 409
        assert "/start_rollout" in response.json()["message"]


def test_resume_after_restart_skips_handed_over_ids(tmp_path: Path) -> None:
    data_dir, input_file = tmp_path / "data", _input(tmp_path, 6)
    with ServerProcess(data_dir, "--task-dir", TASKS) as server:
        client = httpx.Client(base_url=server.url, timeout=30)
        run_id = start_run(client, input_file, task_type="external", repeats=2)
        for i in range(3):
            for _ in range(2):
                client.post("/buffer/write", json=make_record(f"i{i}"))
        client.post("/buffer/write", json=make_record("i3"))  # a half-written group survives the restart
        handed = client.post("/get_rollout_data", json={"num": 4}).json()["data"]["meta_info"]["finished_groups"]
        assert handed == ["i0", "i1"]
    with ServerProcess(data_dir, "--task-dir", TASKS) as server:
        client = httpx.Client(base_url=server.url, timeout=30)
        again = client.post("/start_rollout", json={"task_type": "external", "input_file": str(input_file),
                                                    "num_repeat_per_sample": "2", "num_epoch": "1",
                                                    "num_process": "4"}).json()
        assert again["run_id"] == run_id and again["created"] is False
        assert again["skipped_instance_ids"] == 2, "handed-over ids are skipped without being told"
        client.post("/buffer/write", json=make_record("i3"))
        records = _read_all(client, run_id)
        assert [r["instance_id"] for r in records] == ["i2", "i2", "i3", "i3"]


def test_sigkill_loses_no_acknowledged_write(tmp_path: Path) -> None:
    data_dir, input_file = tmp_path / "data", _input(tmp_path, 400)
    acknowledged: list[str] = []
    server = ServerProcess(data_dir, "--task-dir", TASKS).start()
    client = httpx.Client(base_url=server.url, timeout=5)
    run_id = start_run(client, input_file, task_type="external", repeats=1)
    stop = threading.Event()

    def writer() -> None:
        with httpx.Client(base_url=server.url, timeout=5) as c:
            for i in range(400):
                if stop.is_set():
                    return
                uid = f"u{i}"
                try:
                    response = c.post("/buffer/write", json=make_record(f"i{i}", uid=uid, run_id=run_id))
                except httpx.HTTPError:
                    return
                if response.status_code == 200 and response.json()["success"]:
                    acknowledged.append(uid)

    thread = threading.Thread(target=writer)
    thread.start()
    while len(acknowledged) < 60:
        assert thread.is_alive(), "writer ended early"
    server.kill(signal.SIGKILL)
    stop.set()
    thread.join(timeout=30)
    assert 60 <= len(acknowledged) < 400, "the kill landed in the middle of the stream"
    server2 = ServerProcess(data_dir, "--task-dir", TASKS)
    server2.port = server.port
    with server2:
        records = _read_all(httpx.Client(base_url=server2.url, timeout=30), run_id)
    uids = [r["uid"] for r in records]
    assert len(uids) == len(set(uids)), "no record twice"
    assert set(acknowledged) <= set(uids), f"lost: {sorted(set(acknowledged) - set(uids))[:5]}"


def test_two_api_processes_on_one_redis_complete_each_group_once(tmp_path: Path) -> None:
    input_file = _input(tmp_path, 60)
    with ServerProcess(tmp_path / "a", "--task-dir", TASKS) as a:
        redis_url = f"unix://{(tmp_path / 'a' / 'redis.sock').resolve()}"
        with ServerProcess(tmp_path / "b", "--task-dir", TASKS, "--redis-url", redis_url) as b:
            run_id = start_run(httpx.Client(base_url=a.url, timeout=30), input_file, task_type="external", repeats=4)

            def writer(url: str, parity: int) -> None:
                with httpx.Client(base_url=url, timeout=30) as c:
                    for i in range(60):
                        for j in range(2):
                            c.post("/buffer/write",
                                   json=make_record(f"i{i}", uid=f"{i}-{parity}-{j}", run_id=run_id))

            threads = [threading.Thread(target=writer, args=(url, p)) for p, url in enumerate((a.url, b.url))]
            for t in threads:
                t.start()
            results: list[list[dict]] = [[], []]

            def reader(url: str, out: list[dict]) -> None:
                with httpx.Client(base_url=url, timeout=30) as c:
                    while any(t.is_alive() for t in threads):
                        answer = c.post("/get_rollout_data", json={"run_id": run_id, "wait_s": 0.2}).json()
                        out.extend(answer["data"]["data"])
                    out.extend(_read_all(c, run_id))

            readers = [threading.Thread(target=reader, args=(url, results[k])) for k, url in enumerate((a.url, b.url))]
            for t in readers:
                t.start()
            for t in threads + readers:
                t.join(timeout=120)
            everything = results[0] + results[1]
            assert len(everything) == 240 and len({r["uid"] for r in everything}) == 240
            per_instance: dict[str, int] = {}
            for r in everything:
                per_instance[r["instance_id"]] = per_instance.get(r["instance_id"], 0) + 1
            assert set(per_instance.values()) == {4}
            stats = httpx.get(f"{a.url}/runs/{run_id}", timeout=30).json()
            assert stats["groups"]["completed"] == 60 and stats["groups"]["consumed"] == 60


def test_group_timeout_hand_over_and_drop(tmp_path: Path) -> None:
    input_file = _input(tmp_path, 4)
    for policy in ("hand_over", "drop"):
        with ServerProcess(tmp_path / policy, "--task-dir", TASKS, "--group-timeout-s", "0.3",
                           "--group-timeout-policy", policy) as server:
            client = httpx.Client(base_url=server.url, timeout=30)
            run_id = start_run(client, input_file, task_type="external", repeats=3)
            client.post("/buffer/write", json=make_record("i0"))
            answer = client.post("/get_rollout_data", json={"wait_s": 5}).json()
            stats = client.get(f"/runs/{run_id}").json()
            if policy == "hand_over":
                assert [r["instance_id"] for r in answer["data"]["data"]] == ["i0"]
                assert stats["groups"]["timed_out_handed"] == 1
            else:
                assert not answer["success"]
                assert stats["drops"]["group_timeout"] == 1
                # one request, so the 0.3 s group timeout cannot fall between i2's writes under load (i1 stays
                # incomplete and may time out before the read too)
                written = client.post("/buffer/write_batch", json={"run_id": run_id, "records": [
                    make_record("i1"), *(make_record("i2") for _ in range(3))]})
                assert written.status_code == 200, written.text
                answer = client.post("/get_rollout_data", json={"wait_s": 5}).json()
                assert [r["instance_id"] for r in answer["data"]["data"]] == ["i2"] * 3, answer
                assert "0:i0" in answer["data"]["meta_info"]["timed_out_groups"]
            late = client.post("/buffer/write", json=make_record("i0"))
            assert late.status_code == 409 and "late write" in late.json()["message"]


def test_task_discovery_reports_broken_modules_and_refuses_duplicates(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "broken_generator.py").write_text("import no_such_module_here\nTASK_TYPE = 'broken'\n")
    (tasks / "fine_generator.py").write_text("TASK_TYPE = 'fine'\ndef run_rollout(data):\n    pass\n")
    with ServerProcess(tmp_path / "data", "--task-dir", str(tasks)) as server:
        listing = httpx.get(f"{server.url}/tasks", timeout=30).json()
        assert "fine" in listing["tasks"] and "math" not in listing["errors"]
        [(path, error)] = [(p, e) for p, e in listing["errors"].items() if "broken" in p]
        assert "no_such_module_here" in error
    (tasks / "again_generator.py").write_text("TASK_TYPE = 'fine'\ndef run_rollout(data):\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "serve", "--port", "0", "--data-dir",
                           str(tmp_path / "data2"), "--task-dir", str(tasks)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "again_generator.py" in proc.stderr and "fine_generator.py" in proc.stderr


def test_a_start_refused_by_the_runtime_stores_no_run(tmp_path: Path) -> None:
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instance_id": "a", "prompt": "1+1?"}\n{"prompt": oops}\n')
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"instance_id": "a", "prompt": "x"}, {"instance_id": "a", "prompt": "y"}])
    with ServerProcess(tmp_path / "data") as server:
        client = httpx.Client(base_url=server.url, timeout=60)
        base = {"task_type": "math", "num_repeat_per_sample": 2, "remote_engine_url": "http://127.0.0.1:9",
                "tokenizer_path": str(qwen_tokenizer_dir("qwen2.5"))}
        for body, needle in (({**base, "input_file": str(bad)}, "line 2"),
                             ({**base, "input_file": str(dup)}, "duplicate"),
                             ({**base, "input_file": str(dup), "remote_engine_url": ""}, "remote_engine_url")):
            response = client.post("/start_rollout", json=body)
            assert response.status_code == 400 and needle in response.json()["message"], response.text
        assert client.get("/runs").json() == {"runs": [], "active_run": None}


def test_serve_with_the_default_relative_data_dir(tmp_path: Path) -> None:
    """The README's first command: `rollout-buffer serve` in some folder, data in ./.rollout-buffer."""
    env = {"PYTHONPATH": str(REPO)}
    with ServerProcess(Path(".rollout-buffer"), cwd=tmp_path, env=env) as server:
        assert httpx.get(f"{server.url}/health", timeout=30).json()["status"] == "ok"
    assert (tmp_path / ".rollout-buffer" / "rollout-buffer.aof").exists()


def test_ctrl_c_stops_the_server_before_its_embedded_redis(tmp_path: Path) -> None:
    """A terminal's Ctrl+C signals the whole foreground process group: the server shuts down cleanly and
    stops its redis-server itself (which is in a session of its own), with nothing logged as lost."""
    import os
    import time

    from tests.support.helpers import free_port

    port, data_dir = free_port(), tmp_path / "data"
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rollout_buffer.cli", "serve", "--port", str(port),
                                 "--data-dir", str(data_dir), "--task-dir", TASKS], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=sigint_default)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        redis_pid = int((data_dir / "redis.pid").read_text())
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl+C
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log_path.read_text()
    assert "Traceback" not in output and "lost Redis" not in output and "WARNING" not in output, output
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(redis_pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "redis-server outlived the server"
        time.sleep(0.05)
