"""Storage: Redis bytes per stored token of `turns`, packed (our store) vs the same turns as JSON.

Both hashes hold the same records' turns (uid -> value) in one real Redis, measured with MEMORY USAGE
(all samples). The whole-record figure (with ~8 KB of message text per record) is printed too. These records
have no forks: the store keeps them as `pack_record` writes them. Printed besides (not a row): a gateway
session whose client edited a late message of a 2,000-token history 200 times, as the store keeps it (shared
prefixes, `wire.shared_prefix`) against the same record with every prompt whole.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import redis

from bench.records import realistic_record
from rollout_buffer.store.embedded import EmbeddedRedis
from rollout_buffer.wire.packing import pack_record
from rollout_buffer.wire.shared_prefix import expand, pack_shared


def _tokens(record: dict[str, Any]) -> int:
    return sum(len(t["prompt_ids"]) + len(t["output_ids"]) for t in record["turns"])


def forked_session(forks: int = 200, history: int = 2000, seed: int = 0) -> tuple[dict[str, Any], list[int | None]]:
    """A gateway session's record: a turn, a turn going on from it, then `forks` edits of the latter's last
    message (each ~20 new prompt tokens and 30 output tokens after the shared history); with the turn hints
    the gateway gives the store."""
    rng = np.random.default_rng(seed)

    def turn(prompt: list[int], outputs: int) -> dict[str, Any]:
        output = rng.integers(0, 151_000, size=outputs).tolist()
        logprobs = (-rng.random(outputs) * 4).astype(np.float32).astype(np.float64).tolist()
        return {"prompt_ids": prompt, "output_ids": output, "output_logprobs": logprobs, "finish_reason": "stop",
                "weight_version": "7"}

    first = turn(rng.integers(0, 151_000, size=history).tolist(), 30)
    second = turn([*first["prompt_ids"], *first["output_ids"], *rng.integers(0, 151_000, size=20).tolist()], 30)
    shared = [*second["prompt_ids"], *second["output_ids"][:5]]
    turns = [first, second, *(turn([*shared, *rng.integers(0, 151_000, size=20).tolist()], 30) for _ in range(forks))]
    record = {"uid": "forked", "instance_id": "i", "messages": [], "reward": 1.0, "extra_info": {}, "turns": turns}
    return record, [None, 0, *([1] * forks)]


def run(quick: bool = False) -> dict[str, Any]:
    count = 200 if quick else 1000
    records = [realistic_record(f"i{i // 8}", f"u{i}", seed=i) for i in range(count)]
    tokens = sum(_tokens(r) for r in records)
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp))
        server.start()
        try:
            client = redis.Redis(unix_socket_path=str(server.socket_path))
            turns_only = [{"uid": r["uid"], "instance_id": r["instance_id"], "turns": r["turns"]} for r in records]
            layouts = {
                "packed_turns": {r["uid"]: pack_record(r) for r in turns_only},
                "json_turns": {r["uid"]: orjson.dumps(r) for r in turns_only},
                "packed_record": {r["uid"]: pack_record(r) for r in records},
                "json_record": {r["uid"]: orjson.dumps(r) for r in records},
            }
            forked, sources = forked_session(50 if quick else 200)
            stored = pack_shared(forked, sources)
            assert expand(stored) == pack_record(forked), "the shared form expands to the whole-prompt form"
            layouts["forked_whole"] = {"forked": pack_record(forked)}
            layouts["forked_shared"] = {"forked": stored}
            usage: dict[str, int] = {}
            for name, mapping in layouts.items():
                client.hset(name, mapping=mapping)
                usage[name] = int(client.memory_usage(name, samples=0))
            client.close()
        finally:
            server.stop()
    forked_tokens = _tokens(forked)
    per_token = {name: value / (forked_tokens if name.startswith("forked") else tokens)
                 for name, value in usage.items()}
    return {
        "records": count,
        "turn_tokens": tokens,
        "bytes_per_token": per_token,
        "ratio": per_token["packed_turns"] / per_token["json_turns"],
        "record_ratio": per_token["packed_record"] / per_token["json_record"],
        "forked_session": {"forks": len(forked["turns"]) - 2, "turn_tokens": forked_tokens,
                           "whole_bytes": usage["forked_whole"], "shared_bytes": usage["forked_shared"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args(argv).quick)
    b = result["bytes_per_token"]
    print(f"storage: {b['packed_turns']:.2f} B/token packed vs {b['json_turns']:.2f} B/token JSON "
          f"-> ratio {result['ratio']:.2f} (target <= 0.4); whole records {result['record_ratio']:.2f}")
    f = result["forked_session"]
    print(f"a session with {f['forks']} forks of a long history: {f['shared_bytes'] / 1024:.0f} KB stored "
          f"({b['forked_shared']:.2f} B/token) vs {f['whole_bytes'] / 1024:.0f} KB with every prompt whole "
          f"({b['forked_whole']:.2f} B/token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
