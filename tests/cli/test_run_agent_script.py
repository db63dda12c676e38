"""scripts/run_agent.sh: starts the buffer, hands training the flags slime needs, stops the buffer after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.helpers import REPO, ServerProcess, free_port, write_jsonl

SCRIPT = REPO / "scripts" / "run_agent.sh"

# A stand-in for `python train.py ...`: parses the buffer flags as slime's `add_rollout_buffer_arguments`
# declares them (unknown flags ignored), checks the buffer through the URL slime would see, prints its argv.
FAKE_TRAIN = """
import argparse, json, sys, urllib.request
args = sys.argv[1:]
parser = argparse.ArgumentParser()
parser.add_argument("--rollout-buffer-url", type=str, default=None)
parser.add_argument("--loss-mask-type", type=str, default="qwen", choices=["qwen", "qwen3", "qwen3_5", "distill_qwen"])
parser.add_argument("--rollout-function-path", type=str)
slime, _ = parser.parse_known_args(args[1:])
url = slime.rollout_buffer_url
health = json.load(urllib.request.urlopen(url + "/health", timeout=5))
tasks = json.load(urllib.request.urlopen(url + "/tasks", timeout=5))
print(json.dumps({"argv": args, "health": health, "tasks": sorted(tasks["tasks"]),
                  "loss_mask_type": slime.loss_mask_type}), flush=True)
sys.exit(int(args[0]))
"""

SLEEPY_TRAIN = """
import os, time
print(os.getpid(), flush=True)
time.sleep(60)
"""


def script_env(tmp_path: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_BUFFER_")}
    env.update(PYTHON=sys.executable, BUFFER_PORT=str(port), ROLLOUT_BUFFER_DATA_DIR=str(tmp_path / "data"),
               ROLLOUT_BUFFER_TASK_DIR=str(REPO / "tests" / "fixtures" / "tasks"), HEALTH_TIMEOUT_S="60",
               STOP_TIMEOUT_S="20")
    return env


def assert_port_closed(port: int) -> None:
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_flags_exit_status_and_the_buffer_is_stopped(tmp_path: Path) -> None:
    port = free_port()
    command = [str(SCRIPT), "--", sys.executable, "-c", FAKE_TRAIN, "7", "--loss-mask-type", "qwen3"]
    done = subprocess.run(command, check=False, env=script_env(tmp_path, port), cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 7, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    argv = report["argv"]
    url = f"http://127.0.0.1:{port}"
    assert argv[argv.index("--rollout-function-path") + 1] == "slime_adapter.agent_rollout.generate_rollout"
    assert argv[argv.index("--rollout-buffer-url") + 1] == url, "slime's own flag, the one its parser reads"
    assert "--agent-rollout-buffer-url" not in argv
    assert report["loss_mask_type"] == "qwen3"
    assert argv.count("--loss-mask-type") == 1 and argv[argv.index("--loss-mask-type") + 1] == "qwen3", \
        "a flag the command already gives is not appended again"
    assert report["health"]["status"] == "ok" and "external" in report["tasks"], "the task dir was passed"
    assert "buffer stopped" in done.stderr
    assert_port_closed(port)
    assert (tmp_path / "data" / "buffer.log").is_file()


def test_a_data_dir_in_use_stops_the_script_naming_its_holder(tmp_path: Path) -> None:
    """A second run_agent.sh (or serve) on the data dir of a running buffer does not share its runs: the
    buffer refuses to start, the script says why and training never starts."""
    with ServerProcess(tmp_path / "data") as first:
        assert first.proc is not None
        port = free_port()
        command = [str(SCRIPT), "--", sys.executable, "-c", FAKE_TRAIN, "0"]
        done = subprocess.run(command, check=False, env=script_env(tmp_path, port), cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert httpx.get(f"{first.url}/health", timeout=30).status_code == 200, "the first buffer serves on"
    assert done.returncode == 1, done.stderr
    assert f"is in use by process {first.proc.pid} (" in done.stderr, done.stderr
    assert done.stdout == "", "training did not start"
    assert_port_closed(port)


def test_sigterm_stops_training_and_buffer(tmp_path: Path) -> None:
    port = free_port()
    env = {**script_env(tmp_path, port), "LOSS_MASK_TYPE": "distill_qwen"}
    proc = subprocess.Popen([str(SCRIPT), "--", sys.executable, "-c", SLEEPY_TRAIN], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        train_pid = int(proc.stdout.readline())  # training runs, so the buffer is healthy
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert time.monotonic() - began < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    with pytest.raises(ProcessLookupError):
        os.kill(train_pid, 0)
    assert_port_closed(port)


# A stand-in for training that starts a slime-style run on each file it was given (the first rollout a real
# training command would ask for) and reports the buffer's answer per file.
START_RUNS = """
import json, sys, urllib.error, urllib.request
url = sys.argv[sys.argv.index("--rollout-buffer-url") + 1]
answers = {}
given = sys.argv[sys.argv.index("--files") + 1:]
for path in given[:next((i for i, a in enumerate(given) if a.startswith("--")), len(given))]:
    body = {"task_type": "slime_style", "input_file": path, "num_repeat_per_sample": "1", "num_epoch": "1",
            "num_process": "1", "remote_buffer_url": url}
    request = urllib.request.Request(url + "/start_rollout", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        answers[path] = urllib.request.urlopen(request, timeout=30).status
    except urllib.error.HTTPError as exc:
        answers[path] = exc.code
print(json.dumps(answers), flush=True)
"""


def test_the_training_commands_data_folders_are_input_roots(tmp_path: Path) -> None:
    """`--prompt-data /datasets/train.jsonl` (and the eval files, either spelling) outside the working directory
    can be read by the buffer, and so can the `--hf-checkpoint` folder (its tokenizer); a file in no named
    folder still cannot."""
    rows = [{"instance_id": "p0", "prompt": "prompt 0"}]
    checkout = tmp_path / "slime"
    checkout.mkdir()
    files = {name: write_jsonl_file(tmp_path / name, rows) for name in
             ("datasets/train.jsonl", "evals/aime.jsonl", "evals-b/gsm8k.jsonl", "evals-c/math.jsonl", "models/qwen/x.jsonl",
              "outside/x.jsonl")}
    local = write_jsonl_file(checkout / "local.jsonl", rows)
    task_dirs = os.pathsep.join(str(REPO / "tests" / "fixtures" / d) for d in ("tasks", "legacy_tasks"))
    env = {**script_env(tmp_path, free_port()), "ROLLOUT_BUFFER_TASK_DIR": task_dirs}
    command = [str(SCRIPT), "--", sys.executable, "-c", START_RUNS,
               "--prompt-data", str(files["datasets/train.jsonl"]),
               "--eval-prompt-data", "aime", str(files["evals/aime.jsonl"]),
               "gsm8k", str(files["evals-b/gsm8k.jsonl"]),
               f"--eval-prompt-data={files['evals-c/math.jsonl']}",
               "--hf-checkpoint", str(files["models/qwen/x.jsonl"].parent), "--files", *map(str, files.values()), str(local)]
    done = subprocess.run(command, check=False, env=env, cwd=checkout, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    outside = str(files.pop("outside/x.jsonl"))
    assert answers == {**{str(path): 200 for path in files.values()}, outside: 403, str(local): 200}, done.stderr
    roots = next(line for line in done.stderr.splitlines() if "input roots" in line)
    assert roots.rsplit(": ", 1)[1].split() == [str(checkout), *(str(path.parent) for path in files.values())]

    spelled = [str(SCRIPT), "--", sys.executable, "-c", START_RUNS, f"--prompt-data={files['datasets/train.jsonl']}",
               f"--hf-checkpoint={files['models/qwen/x.jsonl'].parent}",
               "--files", str(files["datasets/train.jsonl"]), str(files["evals/aime.jsonl"]), outside,
               str(files["models/qwen/x.jsonl"])]
    env["ROLLOUT_BUFFER_INPUT_ROOT"] = str(Path(outside).parent)  # its folders stay roots beside the flags
    again = subprocess.run(spelled, check=False, env=env, cwd=checkout, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1]) == {str(files["datasets/train.jsonl"]): 200,
                                                                 str(files["evals/aime.jsonl"]): 403, outside: 200,
                                                                 str(files["models/qwen/x.jsonl"]): 200}


def write_jsonl_file(path: Path, rows: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_jsonl(path, rows)
