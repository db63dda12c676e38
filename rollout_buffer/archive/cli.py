"""`rollout-buffer export` and `rollout-buffer reverify`: a run's archive, as a file, and re-scored.

A run's archive folder is `--archive PATH` (the run's own folder) or `<--archive-dir>/<RUN>` (the folder the
server's `--archive-dir` names; also read from `ROLLOUT_BUFFER_ARCHIVE_DIR`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import orjson

from rollout_buffer.archive import export as exporting
from rollout_buffer.archive import reverify as reverifying
from rollout_buffer.archive.sink import RUN_FILE

HarborFactory = Callable[..., Any]  # (run folder, task folders, tests=, options=, network=) -> async reward(record)


def _folder_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="the run id")
    parser.add_argument("--archive-dir", type=Path, default=os.environ.get("ROLLOUT_BUFFER_ARCHIVE_DIR"),
                        help="the server's --archive-dir (the run's folder is DIR/RUN)")
    parser.add_argument("--archive", type=Path, help="the run's archive folder itself")


def _run_folder(args: argparse.Namespace) -> Path:
    if args.archive is not None:
        return Path(args.archive)
    if args.archive_dir is None:
        raise SystemExit("name the run's archive: --archive PATH or --archive-dir DIR")
    return Path(args.archive_dir) / args.run


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rollout-buffer export", description=exporting.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _folder_flags(parser)
    parser.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    parser.add_argument("--out", type=Path, help="output file (default RUN.parquet or RUN.jsonl)")
    parser.add_argument("--redis-url", help="also the records the archive has not written yet, and those still in "
                                            "the buffer, from this Redis")
    args = parser.parse_args(argv)
    folder = _run_folder(args) if (args.archive or args.archive_dir) else None
    batches: Iterator[list[dict[str, Any]]] = iter(())
    if folder is not None:
        batches = exporting.archive_batches(folder)
    client = None
    if args.redis_url:
        import redis

        client = redis.Redis.from_url(args.redis_url)
        batches = chain(batches, exporting.redis_batches(client, args.run))
    elif folder is None:
        parser.error("name the archive (--archive or --archive-dir) or the Redis (--redis-url)")
    out = args.out or Path(f"{args.run}.{args.format}")
    try:
        count = exporting.export(batches, out, args.format)
    finally:
        if client is not None:
            client.close()
    print(f"{count} record(s) of run {args.run} written to {out}")
    return 0


def _judge_fn(args: argparse.Namespace) -> Any:
    from rollout_buffer.tasks.judge import Judge

    rubric = args.rubric or ""
    if rubric.startswith("@"):
        rubric = Path(rubric[1:]).read_text()
    if not rubric.strip():
        raise reverifying.ReverifyError("--judge needs --rubric TEXT (or @FILE)")
    judge = Judge(args.judge, args.judge_model, rubric, retries=args.judge_retries,
                  concurrency=args.judge_concurrency, api_key=os.environ.get("ROLLOUT_BUFFER_JUDGE_API_KEY"))

    async def reward(record: dict[str, Any]) -> dict[str, Any]:
        return await judge.score(record["messages"], (record.get("extra_info") or {}).get("label"))

    return reward


def _reward_fn(args: argparse.Namespace, folder: Path, harbor: HarborFactory | None = None) -> tuple[Any, str]:
    if args.harbor_tasks:
        if harbor is None:
            raise reverifying.ReverifyError("Harbor re-verification is not available in this entry point")
        options = {"docker_host": args.docker_host} if args.docker_host else {}
        if args.forwarder_image:  # the tests' egress forwarder runs there, as a run's (`--forwarder-image`)
            options["forwarder_image"] = args.forwarder_image
        network = {"verifier": tuple(args.egress_verifier), "mirrors": tuple(args.egress_mirror),
                   "proxy": args.egress_proxy}
        try:
            fn = harbor(folder, args.harbor_tasks, tests=args.tests, options=options, network=network)
        except ValueError as exc:  # a bad egress grant, named before anything runs
            raise reverifying.ReverifyError(str(exc)) from exc
        return fn, f"harbor:{args.harbor_tasks.name}"
    if args.egress_verifier or args.egress_mirror or args.egress_proxy or args.forwarder_image:
        raise reverifying.ReverifyError("--egress-verifier, --egress-mirror, --egress-proxy and --forwarder-image need "
                                        "--harbor-tasks")
    if args.tests:
        raise reverifying.ReverifyError("--tests needs --harbor-tasks (the run's Harbor task folders)")
    if args.judge:
        return _judge_fn(args), f"judge:{args.judge_model}"
    if args.reward:
        return reverifying.load_reward_fn(args.reward), args.reward
    from rollout_buffer.tasks.discovery import discover

    task_type = args.task
    if task_type is None and (folder / RUN_FILE).is_file():
        task_type = orjson.loads((folder / RUN_FILE).read_bytes()).get("task_type")
    if not task_type:
        raise reverifying.ReverifyError("the run's task type is unknown: pass --task or --reward")
    task = discover(args.task_dir or []).get(task_type)
    if task is None:
        raise reverifying.ReverifyError(f"no task module {task_type!r} (add its folder with --task-dir)")
    if task.reward is None:
        raise reverifying.ReverifyError(f"task {task_type!r} defines no reward(record) function; pass --reward")
    return task.reward, f"{task_type}:{task.path.name}"


def reverify_main(argv: list[str], harbor: HarborFactory | None = None) -> int:
    """`harbor`: what re-verifies Harbor records in containers (the CLI passes
    `rollout_buffer.agents.harbor.reverify.harbor_reward`; this package does not import the sandboxes)."""
    parser = argparse.ArgumentParser(prog="rollout-buffer reverify", description=reverifying.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _folder_flags(parser)
    parser.add_argument("--task-dir", type=Path, action="append", help="folder of task modules (repeatable)")
    parser.add_argument("--task", help="task type whose reward(record) to run (default: the run's)")
    parser.add_argument("--reward", help="a reward function instead: FILE.py:FUNCTION or MODULE:FUNCTION")
    parser.add_argument("--judge", metavar="URL", help="an LLM judge instead: an OpenAI-compatible base URL (.../v1; "
                                                       "key from ROLLOUT_BUFFER_JUDGE_API_KEY; docs/judges.md)")
    parser.add_argument("--judge-model", default="default", help="the judge's model name (default 'default')")
    parser.add_argument("--rubric", help="the judge's rubric: text, or @FILE")
    parser.add_argument("--judge-retries", type=int, default=3, help="retries of a failed judge call (default 3)")
    parser.add_argument("--judge-concurrency", type=int, default=8, help="judge calls at once (default 8)")
    parser.add_argument("--harbor-tasks", type=Path, metavar="DIR",
                        help="re-run a Harbor run's tests on its kept work products, in fresh containers: DIR holds "
                             "the task folders (docs/reverify.md)")
    parser.add_argument("--tests", type=Path, metavar="DIR",
                        help="with --harbor-tasks: new tests, a tests/ folder for every task or DIR/<task>/tests/")
    parser.add_argument("--docker-host", help="with --harbor-tasks: the Docker Engine (default: DOCKER_HOST, else "
                                              "/var/run/docker.sock)")
    parser.add_argument("--egress-verifier", action="append", default=[], metavar="HOST",
                        help="with --harbor-tasks: a host the tests may reach through their egress proxy, as serve's "
                             "(repeatable; a networked task's tests are refused every host without it)")
    parser.add_argument("--egress-mirror", action="append", default=[], metavar="HOST=ADDR:PORT",
                        help="with --harbor-tasks: serve an allowed host from a mirror, as serve's (repeatable)")
    parser.add_argument("--egress-proxy", default="", metavar="URL",
                        help="with --harbor-tasks: an upstream HTTP proxy, as serve's")
    parser.add_argument("--forwarder-image", metavar="IMAGE",
                        help="with --harbor-tasks: an image with python3 that runs the tests' egress forwarder, as "
                             "serve's (task images then need none)")
    args = parser.parse_args(argv)
    folder = _run_folder(args)
    try:
        fn, source = _reward_fn(args, folder, harbor)
        summary = reverifying.reverify(folder, fn, source)
    except reverifying.ReverifyError as exc:
        print(f"rollout-buffer reverify: error: {exc}", file=sys.stderr)
        return 2
    print(orjson.dumps(reverifying.asdict(summary), option=orjson.OPT_INDENT_2).decode())
    return 0
