"""`rollout-buffer test-engine` (or `python -m rollout_buffer.testing.engine`): serve a test engine until
SIGINT or SIGTERM, on uvloop with the worker's GC tuning, since it shares the cores it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

from rollout_buffer.testing.engine.config import EngineConfig
from rollout_buffer.testing.engine.server import TestEngine
from rollout_buffer.testing.engine.server import ENGINE_TEMPLATES

# EngineConfig fields settable from the command line (all of them but the one-shot fault counts), with the
# help each flag shows; `POST /_test/config` changes them while the engine runs
_KNOBS: dict[str, str] = {
    "seed": "seed of the scripted answers: the same seed, request id and prompt give the same output",
    "latency_s": "seconds each generation waits before answering",
    "latency_jitter_s": "up to this many seconds more, drawn per request",
    "p_correct": "probability that an arithmetic answer is right (the rest are off by one)",
    "noise_tokens": "random tokens before the scripted answer: between LOW and HIGH of them",
    "error_rate": "fraction of requests answered HTTP 500",
    "abort_rate": "fraction of requests aborted (finish_reason abort), as SGLang does on /abort_request",
    "hang_rate": "fraction of requests that never answer (until the client gives up)",
    "malformed_rate": "fraction of requests answered with a body that is not JSON",
    "weight_version": "the weight version stamped on every answer (meta_info.weight_version)",
    "spec_draft_tokens": "speculative decoding: draft tokens reported per step (0: off)",
    "moe_layers": "MoE layers in the routed-experts replay (return_routed_experts)",
    "moe_topk": "experts routed per token in that replay",
    "moe_experts": "experts per MoE layer in that replay",
}


def build_parser() -> argparse.ArgumentParser:
    """The command's flags, each with its help and default (`--help` shows both)."""
    parser = argparse.ArgumentParser(
        prog="rollout-buffer test-engine", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="An SGLang-compatible engine for tests and demos: /generate (token in, token out), "
                    "/v1/chat/completions, scripted arithmetic answers with tool calls, the real Qwen tokenizer "
                    "(built offline). Serves until Ctrl+C or SIGTERM.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (0: any free port)")
    parser.add_argument("--template", choices=ENGINE_TEMPLATES, default="qwen2.5",
                        help='chat template and tokenizer; a run names it as "tokenizer_path": "test:<template>"')
    parser.add_argument("--engine-id", help="name of this engine in answers and stats (default: host:port)")
    defaults = EngineConfig()
    for name, text in _KNOBS.items():
        flag, default = "--" + name.replace("_", "-"), getattr(defaults, name)
        if name == "noise_tokens":
            parser.add_argument(flag, type=int, nargs=2, metavar=("LOW", "HIGH"), default=default, help=text)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=text)
    return parser


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: serve until SIGINT/SIGTERM."""
    args = _parse_args(argv)
    knobs = {name: getattr(args, name) for name in _KNOBS}
    engine = TestEngine(template=args.template, engine_id=args.engine_id, **knobs)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
        try:
            url = await engine.start(args.host, args.port)
        except OSError as exc:  # a port in use, an address not on this machine: one line, not a traceback
            raise _CannotListen(f"rollout-buffer test-engine: cannot listen on {args.host}:{args.port}: "
                                f"{os.strerror(exc.errno) if exc.errno else exc} (choose another --port)") from None
        print(f"test engine ({args.template}) listening on {url}", flush=True)
        print(f'its tokenizer, for /start_rollout: "tokenizer_path": "test:{args.template}" '
              f"(files: {engine.tokenizer_path})", flush=True)
        try:
            await stop.wait()
        finally:
            await engine.stop()

    from rollout_buffer.runtime.worker_main import event_loop_factory, tune_gc

    tune_gc()  # the engine process is long-lived and allocation-heavy, like a worker
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # uvloop: it shares the cores it serves
            runner.run(serve())
    except _CannotListen as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


class _CannotListen(Exception):
    """The engine could not bind its address."""
