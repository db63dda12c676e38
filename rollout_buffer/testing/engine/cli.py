"""`rollout-buffer test-engine` (or `python -m rollout_buffer.testing.engine`): serve a test engine until
SIGINT or SIGTERM, on uvloop with the worker's GC tuning, since it shares the cores it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from rollout_buffer.testing.engine.config import EngineConfig
from rollout_buffer.testing.engine.server import TestEngine
from rollout_buffer.testing.tokenizer import TEMPLATES

# EngineConfig fields settable from the command line (all of them but the one-shot fault counts)
_KNOBS = ("seed", "latency_s", "latency_jitter_s", "p_correct", "noise_tokens", "error_rate", "abort_rate",
          "hang_rate", "malformed_rate", "weight_version")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="test-engine", description="SGLang-compatible test engine.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--template", choices=TEMPLATES, default="qwen2.5")
    parser.add_argument("--engine-id", help="name of this engine in answers and stats (default: host:port)")
    defaults = EngineConfig()
    for name in _KNOBS:
        flag, default = "--" + name.replace("_", "-"), getattr(defaults, name)
        if name == "noise_tokens":
            parser.add_argument(flag, type=int, nargs=2, metavar=("LOW", "HIGH"), default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    return parser.parse_args(argv)


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
        url = await engine.start(args.host, args.port)
        print(f"test engine ({args.template}) listening on {url}", flush=True)
        print(f'its tokenizer, for /start_rollout: "tokenizer_path": "test:{args.template}" '
              f"(files: {engine.tokenizer_path})", flush=True)
        try:
            await stop.wait()
        finally:
            await engine.stop()

    from rollout_buffer.runtime.worker_main import event_loop_factory, tune_gc

    tune_gc()  # the engine process is long-lived and allocation-heavy, like a worker
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # uvloop: it shares the cores it serves
        runner.run(serve())
    return 0
