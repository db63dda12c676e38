"""`rollout-buffer demo`: the whole loop on one machine, in well under a minute.

It starts the SGLang test engine and, unless `--url` names a running buffer (whose dashboard then shows the
run), a `rollout-buffer serve` process of its own (embedded Redis in a temp dir); writes a small math JSONL,
runs the built-in `math` task on it and shows what a trainer would receive from `/get_rollout_data`: whole
groups, GRPO-normalised rewards, token counts, and one record.

With `--agent`, the same prompts run as an `agent_command` task instead: each rollout runs an agent command
in its own sandbox against the agent gateway (by default `rollout_buffer.testing.demo_agent`, an OpenAI
Chat Completions tool loop; `--agent-command` names another, e.g. `"claude -p {prompt} --output-format
json"`), and the exact-answer verifier scores what it prints.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
from tqdm import tqdm

import rollout_buffer
from rollout_buffer.security.auth import token_from_environment
from rollout_buffer.testing.engine import run_engine_in_thread
from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir

# where `demo --url` writes its prompts: under the current folder, which a server started there may read
_LOCAL_DIR = ".rollout-buffer-demo"


def auth_headers() -> dict[str, str]:
    """The buffer's token from the environment (ROLLOUT_BUFFER_AUTH_TOKEN[_FILE]), as `status` sends it."""
    token = token_from_environment()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the server at {url} did not become healthy in {timeout_s:g}s")


def _write_prompts(path: Path, count: int) -> None:
    rows = [{"instance_id": f"demo-{i}", "prompt": f"What is {3 * i + 4} * {i + 2} - {i}?",
             "label": str((3 * i + 4) * (i + 2) - i)} for i in range(count)]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def _compact(record: dict[str, Any]) -> dict[str, Any]:
    """One record for printing: long token lists cut to their ends."""
    shown = {k: v for k, v in record.items() if k not in ("turns", "messages")}
    shown["messages"] = record["messages"]
    shown["turns"] = [
        {**turn, "prompt_ids": f"[{len(turn['prompt_ids'])} ids ... {turn['prompt_ids'][-4:]}]",
         "output_ids": f"[{len(turn['output_ids'])} ids ... {turn['output_ids'][-4:]}]",
         "output_logprobs": f"[{len(turn['output_logprobs'])} logprobs]"}
        for turn in record.get("turns") or []
    ]
    return shown


def _summary(groups: list[list[dict[str, Any]]], seconds: float) -> str:
    lines = [f"\n{len(groups)} groups, {sum(len(g) for g in groups)} trajectories in {seconds:.1f}s\n",
             f"{'group':<10} {'epoch':>5}  {'raw rewards':<20} {'GRPO rewards':<34} {'prompt/output tokens'}"]
    for group in groups:
        raw = " ".join(f"{r['reward'] if r.get('raw_reward') is None else r['raw_reward']:.0f}" for r in group)
        normalised = " ".join(f"{r['reward']:+.2f}" for r in group)
        prompt = len(group[0]["turns"][0]["prompt_ids"])
        outputs = ",".join(str(sum(len(t["output_ids"]) for t in r["turns"])) for r in group)
        lines.append(f"{group[0]['instance_id']:<10} {group[0]['epoch']:>5}  {raw:<20} {normalised:<34} "
                     f"{prompt}/{outputs}")
    return "\n".join(lines)


@contextmanager
def own_server(workdir: Path, tokenizer_path: str, agents: bool = False) -> Iterator[str]:
    """A `rollout-buffer serve` of the demo's own on a free port (embedded Redis in `workdir`); its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(workdir / "server.log", "ab") as log:
        # the prompts and the tokenizer live outside the current directory: name them as input roots
        server = subprocess.Popen([sys.executable, "-m", "rollout_buffer.cli", "serve", "--port", str(port),
                                   "--data-dir", str(workdir / "data"), "--log-level", "warning",
                                   "--input-root", str(workdir), "--input-root", tokenizer_path,
                                   # `--agent`: the demo's agent is this package's own script, on this machine
                                   *(["--agent-sandbox", "local"] if agents else [])],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, server, 30)
            yield url
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


def _check_reachable(url: str) -> str | None:
    """Why the buffer at `url` cannot run the demo, or None."""
    try:
        httpx.get(f"{url}/health", timeout=5).raise_for_status()
    except httpx.HTTPError as exc:
        return f"cannot reach a buffer at {url}: {exc}"
    return None


def agent_options(command: str | None) -> dict[str, Any]:
    """The `agent` run options of `--agent`: the demo agent (with this package importable), or `command`."""
    if command:
        return {"command": command, "api": "both", "timeout_s": 300, "verifier": {"type": "exact_answer"},
                "env": {"PATH": os.environ.get("PATH", os.defpath), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"},
                "files": {"~/.claude/settings.json": {"permissions": {"allow": ["Bash"]}}}}
    package_root = str(Path(rollout_buffer.__file__).resolve().parent.parent)
    return {"command": [sys.executable, "-m", "rollout_buffer.testing.demo_agent", "{prompt}"], "api": "openai",
            "env": {"PYTHONPATH": package_root}, "timeout_s": 60, "verifier": {"type": "exact_answer"}}


def roll_out(url: str, engine_url: str, input_file: Path, tokenizer_path: str, prompts: int, repeats: int,
             timeout_s: float, agent: dict[str, Any] | None = None) -> int:
    """Start a run of its own (a fresh run id, so a second demo on the same server starts anew), collect every
    group as a trainer would, and print them."""
    body = {"task_type": "math", "input_file": str(input_file), "num_repeat_per_sample": repeats,
            "num_epoch": 1, "num_process": 64, "remote_engine_url": engine_url, "tokenizer_path": tokenizer_path,
            "run_id": f"demo-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:6]}",
            "sampling_params": {"max_tokens": 256, "temperature": 1.0}}
    if agent is not None:  # each rollout runs the agent command against its own gateway session
        body.update(task_type="agent_command", agent=agent, remote_buffer_url=url, num_process=16)
    with httpx.Client(base_url=url, timeout=60, headers=auth_headers()) as client:
        started = time.monotonic()
        answer = client.post("/start_rollout", json=body)
        if answer.status_code >= 400:
            print(f"the buffer at {url} refused the demo's run: {answer.status_code} {answer.text}",
                  file=sys.stderr)
            if answer.status_code == 403 and "input_file" in answer.text:
                print(f"run the demo from the folder the server started in, or start it with --input-root "
                      f"{input_file.parent}", file=sys.stderr)
            return 1
        run_id = answer.json()["run_id"]
        print(f"run {run_id}: watch it at {url}/?run={run_id}")
        groups: list[list[dict[str, Any]]] = []
        with tqdm(total=prompts, unit="group", desc="groups ready") as bar:
            while len(groups) < prompts:
                if time.monotonic() - started > timeout_s:
                    print(f"timed out; run state: {client.get(f'/runs/{run_id}').json()}")
                    return 1
                data = client.post("/get_rollout_data", json={"run_id": run_id, "wait_s": 1.0}).json()
                by_group: dict[tuple[int, str], list[dict[str, Any]]] = {}
                for record in data["data"]["data"]:
                    by_group.setdefault((record["epoch"], record["instance_id"]), []).append(record)
                groups.extend(by_group.values())
                bar.update(len(by_group))
        elapsed = time.monotonic() - started
        print(_summary(groups, elapsed))
        print("\none record as the trainer receives it (token lists shortened):")
        print(orjson.dumps(_compact(groups[0][0]), option=orjson.OPT_INDENT_2).decode())
        # a worker acknowledges its task just after the record that completed the group: give the
        # last acknowledgements a moment to land before showing the counters
        deadline = time.monotonic() + 10
        tasks = client.get(f"/runs/{run_id}").json()["tasks"]
        while tasks["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
            tasks = client.get(f"/runs/{run_id}").json()["tasks"]
        print(f"\nrun detail: GET {url}/runs/{run_id} -> tasks {tasks}")
    return 0


def run_demo(prompts: int, repeats: int, latency_s: float, timeout_s: float, workdir: Path,
             url: str | None = None, agent: dict[str, Any] | None = None) -> int:
    """Against the buffer at `url`, or (None) against one the demo starts and stops itself."""
    if url is not None:
        problem = _check_reachable(url)
        if problem is not None:
            print(f"rollout-buffer demo: {problem}", file=sys.stderr)
            return 1
    input_file = workdir / "math.jsonl"
    _write_prompts(input_file, prompts)
    with run_engine_in_thread(template="qwen2.5", latency_s=latency_s, seed=1) as engine, ExitStack() as stack:
        if url is None:
            tokenizer_path = str(qwen_tokenizer_dir("qwen2.5"))
            url = stack.enter_context(own_server(workdir, tokenizer_path, agents=agent is not None))
            print(f"no --url given: the demo runs a buffer of its own at {url} (data in {workdir}), stopped "
                  f"when it ends; `rollout-buffer demo --url http://127.0.0.1:8889` runs it against yours")
        else:
            tokenizer_path = "test:qwen2.5"  # the server's own copy of the test tokenizer
            print(f"the demo runs against the buffer at {url} (prompts in {input_file})")
        print(f"test engine at {engine.url}, buffer at {url}")
        return roll_out(url, engine.url, input_file, tokenizer_path, prompts, repeats, timeout_s, agent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout-buffer demo", description=__doc__)
    parser.add_argument("--prompts", type=int, default=8, help="math prompts (= groups) to roll out")
    parser.add_argument("--repeats", type=int, default=4, help="samples per prompt (group size)")
    parser.add_argument("--latency-s", type=float, default=0.2, help="test engine latency per call")
    parser.add_argument("--timeout-s", type=float, default=45.0, help="give up after this long")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (server log, Redis data)")
    parser.add_argument("--url", help="run against the buffer at this URL (e.g. http://127.0.0.1:8889, whose "
                                      "dashboard then shows the run); its prompts file is written under "
                                      f"./{_LOCAL_DIR}, inside the server's default input root when run "
                                      "from the folder the server started in (default: a buffer of its own)")
    parser.add_argument("--agent", action="store_true", help="run an agent command per rollout (agent_command task)")
    parser.add_argument("--agent-command", default=None,
                        help="the agent's command template (implies --agent), "
                             "e.g. 'claude -p {prompt} --output-format json'")
    args = parser.parse_args(argv)
    agent = agent_options(args.agent_command) if args.agent or args.agent_command else None
    url = args.url.rstrip("/") if args.url else None
    if url is not None:
        workdir = Path(_LOCAL_DIR)
        workdir.mkdir(exist_ok=True)
        return run_demo(args.prompts, args.repeats, args.latency_s, args.timeout_s, workdir.resolve(), url, agent)
    if args.keep:
        return run_demo(args.prompts, args.repeats, args.latency_s, args.timeout_s,
                        Path(tempfile.mkdtemp(prefix="rb-demo-")), agent=agent)
    with tempfile.TemporaryDirectory(prefix="rb-demo-") as tmp:
        return run_demo(args.prompts, args.repeats, args.latency_s, args.timeout_s, Path(tmp), agent=agent)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
