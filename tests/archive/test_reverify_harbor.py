"""`rollout-buffer reverify --harbor-tasks` on a real Harbor run (docker backend, a scripted agent): the run
keeps each rollout's work products beside its Parquet (`agent.verify.keep_work`), and re-verification runs
the task's tests on them in fresh containers of the task image: the same tests give the same rewards, new
tests (`--tests`) the new ones, a work product altered after the fact is refused (counted failed, its reward
kept), and the engine gets no call."""

from __future__ import annotations

import contextlib
import http.server
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow.dataset as ds
import pytest

from tests.support.docker_env import DockerEnv, docker_env, docker_sandboxes_of  # noqa: F401 - the session fixture
from tests.support.harbor_attacks import AGENT, write_task
from tests.support.helpers import REPO, ServerProcess
from tests.support.runtime_helpers import drain, wait_status

pytestmark = pytest.mark.timeout(300)


def _checks(answer: str) -> str:
    return ("#!/bin/bash\nif [ \"$(cat /app/answer.txt 2>/dev/null)\" = \"" + answer + "\" ]; then "
            "echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")


def _cli(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "reverify", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=180,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return orjson.loads(done.stdout)


FETCHING_TEST = ("#!/bin/bash\npython3 - <<'PY'\nimport urllib.request\ntry:\n"
                 "    want = urllib.request.urlopen('http://HOST/answer', timeout=10).read().decode()\n"
                 "except Exception as exc:\n    print('fetch failed:', exc)\n    want = None\n"
                 "got = open('/app/answer.txt').read().strip()\n"
                 "open('/logs/verifier/reward.txt', 'w').write('1' if got == want else '0')\nPY\n")


@contextlib.contextmanager
def answer_host(answer: str) -> Iterator[str]:
    """A host on 127.0.0.2 (not a loopback name the proxy variables exempt) serving the expected answer."""
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            body = answer.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.2:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _rows(folder: Path) -> dict[str, dict[str, Any]]:
    return {r["instance_id"]: r for r in ds.dataset(str(folder), format="parquet").to_table().to_pylist()}


def test_harbor_reverify_in_fresh_containers(tmp_path: Path, docker_env: DockerEnv,  # noqa: F811
                                             rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    tasks, archive = tmp_path / "tasks", tmp_path / "archive"
    # the tests may reach the network where the operator grants it (a later re-verification's do)
    write_task(tasks, "right", docker_env.image, "echo 7919 > /app/answer.txt", _checks("7919"),
               extra='network_mode = "public"\n')
    write_task(tasks, "wrong", docker_env.image, "echo 7917 > /app/answer.txt", _checks("7919"),
               extra='network_mode = "public"\n')
    run_id = f"keep-{uuid.uuid4().hex[:8]}"
    options = {"docker_host": docker_env.url, "owner": f"keep-{uuid.uuid4().hex[:6]}"}
    with ServerProcess(tmp_path / "data", "--agent-sandbox", "docker", "--archive-dir", str(archive),
                       "--archive-interval-s", "0.2") as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            answer = client.post("/start_rollout", json={
                "task_type": "agent_command", "input_file": str(tasks), "num_repeat_per_sample": 1, "num_process": 2,
                "remote_engine_url": rollout_engine.url, "tokenizer_path": qwen_tokenizer_path, "run_id": run_id,
                "sampling_params": {"max_tokens": 8},
                "agent": {**AGENT, "verify": {"mode": "clean", "keep_work": True},
                          "sandbox": {"backend": "docker", "options": options}}})
            assert answer.status_code == 200, answer.text
            wait_status(client, run_id, "finished", timeout_s=200)
            assert {r["instance_id"]: r["reward"] for r in drain(client, run_id, 2)} == {"right": 1.0, "wrong": 0.0}
            deadline = time.monotonic() + 60
            while client.get(f"/runs/{run_id}").json()["archive"]["archived"] < 2:
                assert time.monotonic() < deadline, "the archive did not catch up"
                time.sleep(0.2)
    folder = archive / run_id
    kept = {name: orjson.loads(row["verifier"])["work_products"] for name, row in _rows(folder).items()}
    assert set(kept["right"]) == {"/app"} and kept["right"]["/app"]["bytes"] > 0
    assert kept["right"]["/app"]["sha256"] != kept["wrong"]["/app"]["sha256"]
    assert sorted(p.name for p in (folder / "_work").iterdir()) == sorted(
        f"{k['/app']['sha256']}.tar" for k in kept.values()), "one content-addressed tar per distinct work folder"
    calls = rollout_engine.stats_dict()["requests"]
    common = ("--archive-dir", str(archive), "--harbor-tasks", str(tasks), "--docker-host", docker_env.url)

    same = _cli(run_id, *common)
    assert (same["records"], same["changed"], same["unchanged"], same["failed"]) == (2, 0, 2, 0), same
    rows = _rows(folder)
    assert {n: (r["reward"], r["reward_version"]) for n, r in rows.items()} == {"right": (1.0, 1), "wrong": (0.0, 1)}
    assert orjson.loads(rows["right"]["reward_history"][-1]["detail"])["mode"] == "clean"

    new_tests = tmp_path / "new-tests"
    new_tests.mkdir()
    (new_tests / "test.sh").write_text(_checks("7917"))  # the changed test: the other answer is the right one
    changed = _cli(run_id, *common, "--tests", str(new_tests))
    assert (changed["up"], changed["down"], changed["failed"]) == (1, 1, 0), changed
    rows = _rows(folder)
    assert {n: r["reward"] for n, r in rows.items()} == {"right": 0.0, "wrong": 1.0}
    assert [v["reward"] for v in rows["right"]["reward_history"]] == [1.0, 1.0, 0.0], "every version kept"

    # tests that fetch the expected answer from a host: refused it without a grant (counted, rewards kept), and
    # scoring as they should once `--egress-verifier` grants it
    with answer_host("7919") as host:
        fetching = tmp_path / "fetching-tests"
        fetching.mkdir()
        (fetching / "test.sh").write_text(FETCHING_TEST.replace("HOST", host))
        refused = _cli(run_id, *common, "--tests", str(fetching))
        assert refused["failed"] == 2 and "no_network" in refused["examples"][0]["error"], refused
        assert {n: r["reward"] for n, r in _rows(folder).items()} == {"right": 0.0, "wrong": 1.0}, "rewards kept"
        granted = _cli(run_id, *common, "--tests", str(fetching), "--egress-verifier", host)
        assert (granted["up"], granted["down"], granted["failed"]) == (1, 1, 0), granted
    assert {n: r["reward"] for n, r in _rows(folder).items()} == {"right": 1.0, "wrong": 0.0}

    tar = folder / "_work" / f"{kept['right']['/app']['sha256']}.tar"
    data = bytearray(tar.read_bytes())
    spot = data.index(b"7919")
    data[spot:spot + 4] = b"7917"  # the right answer altered after the fact into the one the new tests want
    tar.write_bytes(bytes(data))
    tampered = _cli(run_id, *common, "--tests", str(new_tests))
    assert tampered["failed"] == 1 and "altered" in tampered["examples"][0]["error"], tampered
    assert _rows(folder)["right"]["reward"] == 1.0, "a tampered work product is never re-scored"
    assert rollout_engine.stats_dict()["requests"] == calls, "re-verification made no engine call"
    assert not docker_sandboxes_of(docker_env, "reverify-"), "every re-verification container was removed"


async def test_work_products_past_their_bound_are_not_kept(docker_env: DockerEnv, tmp_path: Path,  # noqa: F811
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_buffer.agents.sandbox import Limits, open_sandbox
    from rollout_buffer.agents.verify import keep

    box: Any = await open_sandbox("docker", name="keep-bound", limits=Limits(),  # as a Harbor task's
                                  options=docker_env.options(image_root=True, workdir="/app"))
    try:
        assert (await box.exec(["sh", "-c", "head -c 20000 /dev/urandom > big.bin"], timeout_s=60)).ok
        store = tmp_path / "_work"
        kept = (await keep.keep_work(box, [box.work, "/nowhere"], store))["work_products"]
        assert kept[box.work]["bytes"] > 20000 and kept["/nowhere"] is None, "a path the agent left no file in"
        monkeypatch.setattr(keep, "MAX_BYTES", 10000)
        past = await keep.keep_work(box, [box.work, "/nowhere"], tmp_path / "bounded")
        assert past["work_products"] is None and past["work_products_dropped"].startswith("over"), past
        assert not list((tmp_path / "bounded").iterdir()), "nothing of a bounded-out rollout is left"
    finally:
        await box.cleanup()
