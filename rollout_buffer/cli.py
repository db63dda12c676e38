"""`rollout-buffer` command line: serve, worker, status, show, test-engine, demo, bench.

Every `serve`/`worker` flag may also come from `ROLLOUT_BUFFER_<FLAG>` (e.g. ROLLOUT_BUFFER_REDIS_URL);
a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollout_buffer.logs import configure_logging, hide_torch_notice
from rollout_buffer.settings import Settings


def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="external Redis (redis://host:port/db); default: embedded Redis")
    parser.add_argument("--redis-cluster", action="store_true", default=None,
                        help="--redis-url names a node of a Redis Cluster: use the cluster client "
                             "(env ROLLOUT_BUFFER_REDIS_CLUSTER=1)")
    parser.add_argument("--redis-wait-replicas", type=int,
                        help="answer a write, leased read or ack only once N replicas have it (Redis WAIT): a "
                             "failover then loses none (default 0: do not wait)")
    parser.add_argument("--data-dir", type=Path, help="embedded Redis data dir (default ./.rollout-buffer)")
    parser.add_argument("--task-dir", type=Path, action="append",
                        help="extra folder of *_generator.py task modules (repeatable)")
    parser.add_argument("--log-level", help="debug | info | warning | error (default info)")
    parser.add_argument("--otlp-endpoint",
                        help="export an OpenTelemetry trace per rollout to this OTLP/HTTP URL (e.g. "
                             "http://collector:4318/v1/traces; default: OTEL_EXPORTER_OTLP_* variables, else off)")
    parser.add_argument("--task-lease-s", type=float,
                        help="seconds before a job whose worker stopped renewing its claim is reclaimed")
    parser.add_argument("--rollout-timeout-s", type=float, help="per-rollout time limit (default 1800)")
    parser.add_argument("--session-timeout-s", type=float,
                        help="a gateway session idle this long finishes as failed (default 600)")
    parser.add_argument("--egress-agent", action="append", metavar="HOST",
                        help="a host (host, host:port or *.domain) agents of tasks that allow internet may reach "
                             "through their sandbox's egress proxy (repeatable; default: none, the model only)")
    parser.add_argument("--egress-verifier", action="append", metavar="HOST",
                        help="a host a Harbor task's verifier may reach through its egress proxy (repeatable; "
                             "default: none), e.g. the package index its test.sh installs from")
    parser.add_argument("--egress-build", action="append", metavar="HOST",
                        help="a host a Harbor task's image build (its Dockerfile's RUN steps) may reach through an "
                             "egress proxy, e.g. the package archive it installs from (repeatable; default: none, "
                             "the build has no network)")
    parser.add_argument("--egress-proxy", metavar="URL",
                        help="an upstream HTTP proxy (http://host:port) that dials for the egress proxies")
    parser.add_argument("--egress-mirror", action="append", metavar="HOST=ADDR:PORT",
                        help="serve an allowed host from a mirror: the egress proxies dial ADDR:PORT for HOST "
                             "(or HOST:PORT), e.g. pypi.org=10.0.0.5:443 (repeatable)")
    parser.add_argument("--forwarder-image", metavar="IMAGE",
                        help="an image with python3 that runs every docker sandbox's model and egress forwarders, in "
                             "a holder container whose network the sandbox joins, so task images need no python3 "
                             "(default: the forwarders run in the task image)")
    parser.add_argument("--gateway-url",
                        help="the gateway as this host's sandbox relays and agents reach it (the balancer in front "
                             "of the API processes): used instead of the run's remote_buffer_url, the address "
                             "/start_rollout arrived on (default: that address)")
    parser.add_argument("--task-folders", choices=["auto", "fetch"],
                        help="Harbor task folders: the one at the dataset's path when it matches the run's copy "
                             "(auto, the default), or always the run's copy (fetch), fetched into this host's cache")
    parser.add_argument("--task-folder-cache", type=Path,
                        help="this host's cache of fetched task folders (default ~/.cache/rollout-buffer/task-folders)")
    parser.add_argument("--task-folder-max-mb", type=float,
                        help="largest Harbor task folder a run may store for worker hosts (default 64)")
    parser.add_argument("--task-folders-max-mb", type=float,
                        help="largest total of one run's stored task folders (default 1024)")
    parser.add_argument("--host-name", help="this worker host's name in the fleet (default: its hostname)")
    parser.add_argument("--host-cpus", type=float, help="cores this host lends to sandboxes (default: usable cores)")
    parser.add_argument("--host-memory-mb", type=int,
                        help="memory this host lends to sandboxes in MB (default: its physical memory)")
    parser.add_argument("--host-sandboxes", type=int, help="sandboxes at once on this host (default: unbounded)")
    parser.add_argument("--capacity-wait-s", type=float,
                        help="a task no host has the cpus or memory for fails as no_host_fits after this (default 600)")
    parser.add_argument("--sandbox-create-rate", type=float,
                        help="sandboxes started per second on this host, at most (default: no limit)")
    parser.add_argument("--host-pause-after", type=int,
                        help="pause this host after N sandbox creations in a row its Engine failed (default 3)")
    parser.add_argument("--host-pause-s", type=float,
                        help="a paused host's back-off before it probes its Engine again, doubled after each failed "
                             "probe (default 30)")
    parser.add_argument("--image-cache-mb", type=float,
                        help="disk budget of the task images this host's workers pulled or built into its Docker "
                             "Engine: past it the least recently used ones no sandbox uses are removed (default: "
                             "no bound)")
    parser.add_argument("--allow-hub-downloads", action="store_true", default=None,
                        help="download tokenizers named by hub id when not in the local Hugging Face cache "
                             "(default: cache only)")


def build_parser() -> argparse.ArgumentParser:
    from rollout_buffer import __version__

    parser = argparse.ArgumentParser(prog="rollout-buffer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rollout-buffer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the buffer HTTP server and its rollout worker processes")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8889)")
    _server_flags(serve)
    serve.add_argument("--timeline-interval-s", type=float,
                       help="seconds between the dashboard's throughput samples of each run (default 5)")
    serve.add_argument("--worker-processes", type=int,
                       help="rollout worker processes beside the API (default: one per core, at most 8; "
                            "0 = rollout loops inside the API process)")
    serve.add_argument("--api-processes", type=int,
                       help="API processes serving the port, any of them any session, run or read (default: one "
                            "per core, at most 8; 1 = the API in this process; docs/scaling.md)")
    serve.add_argument("--workers", type=int, help="rollout loops per worker process (default 1; 0 = API only, "
                                                   "no rollouts)")
    serve.add_argument("--max-body-mb", type=float, help="largest accepted request body in MB, on every route "
                                                         "(default 64; writes have this limit)")
    serve.add_argument("--max-gateway-body-mb", type=float,
                       help="largest model request (/v1/...) body in MB (default 16)")
    serve.add_argument("--max-control-body-mb", type=float,
                       help="largest body of /start_rollout, reads, acks, sessions and /init in MB (default 16)")
    serve.add_argument("--max-prompt-tokens", type=int,
                       help="longest prompt of a gateway turn in tokens (default 262144)")
    serve.add_argument("--max-session-turns", type=int, help="turns one gateway session may take (default 1000)")
    serve.add_argument("--max-session-forks", type=int,
                       help="forks (edited, rewound or compacted histories) of one session (default 100)")
    serve.add_argument("--max-session-mb", type=float, help="token data one session may store in MB (default 256)")
    serve.add_argument("--max-open-sessions-per-run", type=int,
                       help="gateway sessions open at once in one run (default 10000)")
    serve.add_argument("--header-timeout-s", type=float,
                       help="close a connection whose request headers are not complete this long after it opened "
                            "(default 5)")
    serve.add_argument("--max-connections", type=int,
                       help="connections held at once (default: 3/4 of the open-file limit, at most 4096); past "
                            "it the oldest one still sending headers is closed, or the new one answered 503")
    serve.add_argument("--max-open-sessions", type=int, help="gateway sessions open at once in the server "
                                                             "(default 50000)")
    serve.add_argument("--appendfsync", choices=["always", "everysec"], help="embedded Redis fsync policy")
    serve.add_argument("--group-timeout-s", type=float, help="close incomplete groups after this long (off by default)")
    serve.add_argument("--group-timeout-policy", choices=["hand_over", "drop"], help="what a group timeout does")
    serve.add_argument("--retain-runs", type=int, help="keep at most N runs: retired runs beyond the N newest "
                                                       "are deleted (default: keep all)")
    serve.add_argument("--run-ttl-s", type=float, help="delete a retired run this many seconds after it ended "
                                                       "(default: keep)")
    serve.add_argument("--archive-dir", type=Path,
                       help="keep every run's finalized records as Parquet shards in DIR/<run_id>/ (docs/archive.md; "
                            "default: only runs whose 'archive' option names a folder)")
    serve.add_argument("--archive-interval-s", type=float, help="seconds between archive flushes (default 1)")
    serve.add_argument("--archive-shard-records", type=int, help="records per archive shard at most (default 1000)")
    network = serve.add_argument_group("running on a network (docs/security.md: Running on a network)")
    network.add_argument("--auth-token", help="require 'Authorization: Bearer TOKEN' on every route but /health "
                                              "(prefer ROLLOUT_BUFFER_AUTH_TOKEN or --auth-token-file: "
                                              "a flag is visible in the process list)")
    network.add_argument("--auth-token-file", type=Path, help="read the token from the first line of this file")
    network.add_argument("--input-root", type=Path, action="append",
                         help="folder that input_file and local tokenizer_path may name (repeatable; "
                              "default: the directory the server started in)")
    network.add_argument("--allow-url", action="append",
                         help="URL prefix the server may call or hand a task module: engines, a slime-style "
                              "module's remote_buffer_url, /init server_url and its callback (repeatable; "
                              "default: any; the list: rollout_buffer/security/outbound.py)")
    network.add_argument("--agent-sandbox", action="append", metavar="NAME",
                         help="enable agent_command runs in this sandbox backend: bwrap, docker, local (isolates "
                              "nothing: trusted agents only) or package.module:factory (repeatable; the first is a "
                              "run's default; default: none, agent commands are refused 403)")
    network.add_argument("--harbor-max-memory-mb", type=int,
                         help="largest memory_mb a Harbor task.toml may ask for (default: the host's memory)")
    network.add_argument("--harbor-max-storage-mb", type=int,
                         help="largest storage_mb a Harbor task.toml may ask for (default 102400)")
    network.add_argument("--max-tasks-per-run", type=int,
                         help="largest lines x num_epoch x num_repeat_per_sample of one run (default 10000000)")
    network.add_argument("--allowed-host", action="append",
                         help="a Host name the server answers to (repeatable; '*' = any; default: the bound name, "
                              "localhost names, and this machine's names on a non-loopback bind; IP literals "
                              "always pass): others are 400, against DNS rebinding")
    network.add_argument("--cors-origin", action="append",
                         help="a web page origin (https://host:port) allowed to call the API from a browser "
                              "(repeatable; default: none)")

    worker = sub.add_parser("worker", help="run rollout workers against a shared Redis")
    _server_flags(worker)
    worker.add_argument("--processes", dest="worker_processes", type=int,
                        help="worker processes (default: one per core, at most 8)")
    worker.add_argument("--workers", type=int, help="rollout loops per worker process (default 1)")
    worker.add_argument("--allow-url", action="append",
                        help="URL prefix this worker's rollouts may call (repeatable; default: any): a run whose "
                             "engines lie outside is left alone, as `serve --allow-url` refuses it")
    worker.add_argument("--agent-sandbox", action="append", metavar="NAME",
                        help="sandbox backend this worker's agent_command rollouts may use (repeatable; as "
                             "`serve --agent-sandbox`; default: none, agent commands fail)")

    sub.add_parser("status", help="show runs, progress and rates of a running buffer (--watch to follow)",
                   add_help=False)
    sub.add_parser("show", help="print one stored rollout (show RUN UID): turns, masks as colour, reward, timeline",
                   add_help=False)
    sub.add_parser("test-engine", help="run the SGLang-protocol test engine", add_help=False)
    sub.add_parser("demo", help="run everything on this machine and show what the trainer receives", add_help=False)
    sub.add_parser("bench", help="run the benchmark suite", add_help=False)
    sub.add_parser("tasks", help="check a folder of Harbor task folders (tasks check DIR [--build] [--solutions])",
                   add_help=False)
    sub.add_parser("export", help="write a run's records (archive and Redis) as one Parquet or JSONL file",
                   add_help=False)
    sub.add_parser("reverify", help="recompute a run's rewards from its archive, without the engine",
                   add_help=False)
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None and k != "command"}
    # one token source: the one given on the command line wins over the other's environment variable
    if "auth_token" in given:
        given.setdefault("auth_token_file", None)
    elif "auth_token_file" in given:
        given["auth_token"] = None
    return Settings(**given)


def _settings_problem(exc: ValidationError) -> str:
    """pydantic's errors as one line per problem, naming the setting where there is one."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error.get("loc", ()))
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        lines.append(f"{where}: {message}" if where else message)
    return "; ".join(lines)


def check_redis(settings: Settings) -> str | None:
    """A problem with an external Redis that start-up would hit (unreachable, or a cluster node without
    --redis-cluster and vice versa), as a message; None when there is none or no external Redis."""
    if not settings.redis_url:
        return None
    import asyncio

    from redis.exceptions import RedisError

    from rollout_buffer.store.redis_client import RedisModeError, check_mode, display_url

    try:
        asyncio.run(check_mode(settings.redis_url, settings.redis_cluster))
    except RedisModeError as exc:
        return str(exc)
    except (RedisError, OSError) as exc:
        return f"cannot reach the Redis at {display_url(settings.redis_url)}: {exc}"
    return None


def warn_if_exposed(settings: Settings) -> bool:
    """Log a loud warning when the server listens beyond loopback without a token; True if it did."""
    from rollout_buffer.security.auth import is_loopback

    if is_loopback(settings.host) or settings.auth_token is not None or settings.auth_token_file is not None:
        return False
    logging.getLogger("rollout_buffer").warning(
        "\n%s\nSERVING ON %s WITHOUT AN AUTH TOKEN: anyone who reaches port %d can start runs, read and delete "
        "every rollout, and make this server call URLs of their choosing. Set ROLLOUT_BUFFER_AUTH_TOKEN (or "
        "--auth-token-file) and see docs/security.md, 'Running on a network'.\n%s", "!" * 100, settings.host,
        settings.port, "!" * 100)
    return True


def serve(settings: Settings) -> int:
    configure_logging(settings.log_level)
    if not settings.redis_url:  # the embedded Redis lives in the data dir: one server per dir
        from rollout_buffer.store.dir_lock import DataDirInUse, lock_data_dir

        try:
            lock_data_dir(settings.data_dir)  # held (the descriptor stays open) until this process exits
        except DataDirInUse as exc:
            print(f"rollout-buffer serve: {exc}", file=sys.stderr)
            return 2
    warn_if_exposed(settings)
    if settings.api_processes > 1:
        from rollout_buffer.api.processes import serve_processes

        return serve_processes(settings)
    from rollout_buffer.api.processes import run_api

    return run_api(settings)


def main(argv: list[str] | None = None) -> int:
    hide_torch_notice()  # before any command imports transformers: the buffer needs no torch
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("export", "reverify"):
        from rollout_buffer.archive.cli import export_main, reverify_main

        if argv[0] == "export":
            return export_main(argv[1:])
        from rollout_buffer.agents.harbor.reverify import harbor_reward

        return reverify_main(argv[1:], harbor=harbor_reward)
    if argv and argv[0] in ("status", "show", "test-engine", "demo", "bench", "tasks"):
        command, rest = argv[0], argv[1:]
        if command == "tasks":
            from rollout_buffer.agents.harbor.check import cli_main
            from rollout_buffer.tasks.harbor_toml import TaskLimits

            return cli_main(rest, TaskLimits.from_settings(Settings()))  # ROLLOUT_BUFFER_HARBOR_MAX_*_MB
        if command == "status":
            from rollout_buffer.status import main as status_main

            return status_main(rest)
        if command == "show":
            from rollout_buffer.status import show_main

            return show_main(rest)
        if command == "test-engine":
            from rollout_buffer.testing.engine import main as engine_main

            return engine_main(rest)
        if command == "demo":
            from rollout_buffer.demo import main as demo_main

            return demo_main(rest)
        # bench/ and tests/ live in the repository, not in the package: run them there, in a process of
        # their own, rather than putting the working directory on this process's import path
        if not os.path.isfile(os.path.join("bench", "__main__.py")):
            print("rollout-buffer bench: run it from the repository root (the bench/ folder is not installed)",
                  file=sys.stderr)
            return 2
        return subprocess.call([sys.executable, "-m", "bench", *rest])
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        print(f"rollout-buffer {args.command}: error: {_settings_problem(exc)}", file=sys.stderr)
        return 2
    if args.command == "worker" and settings.worker_processes < 1:
        print("rollout-buffer worker: --processes must be at least 1", file=sys.stderr)
        return 2
    problem = check_redis(settings)
    if problem is not None:
        print(f"rollout-buffer {args.command}: error: {problem}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(settings)
    configure_logging(settings.log_level)
    if settings.worker_processes > 1:
        from rollout_buffer.runtime.supervisor import run_supervised_workers

        return run_supervised_workers(settings)
    from rollout_buffer.runtime.worker_main import run_worker

    return run_worker(settings)


if __name__ == "__main__":
    sys.exit(main())
