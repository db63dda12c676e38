"""Storage: Redis bytes per stored token of `turns`, packed (our store) vs the same turns as JSON.

Both hashes hold the same records' turns (uid -> value) in one real Redis, measured with MEMORY USAGE
(all samples). The whole-record figure (with ~8 KB of message text per record) is printed too.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
import redis

from bench.records import realistic_record
from rollout_buffer.store.embedded import EmbeddedRedis
from rollout_buffer.wire.packing import pack_record


def _tokens(record: dict[str, Any]) -> int:
    return sum(len(t["prompt_ids"]) + len(t["output_ids"]) for t in record["turns"])


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
            usage: dict[str, int] = {}
            for name, mapping in layouts.items():
                client.hset(name, mapping=mapping)
                usage[name] = int(client.memory_usage(name, samples=0))
            client.close()
        finally:
            server.stop()
    per_token = {name: value / tokens for name, value in usage.items()}
    return {
        "records": count,
        "turn_tokens": tokens,
        "bytes_per_token": per_token,
        "ratio": per_token["packed_turns"] / per_token["json_turns"],
        "record_ratio": per_token["packed_record"] / per_token["json_record"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args(argv).quick)
    b = result["bytes_per_token"]
    print(f"storage: {b['packed_turns']:.2f} B/token packed vs {b['json_turns']:.2f} B/token JSON "
          f"-> ratio {result['ratio']:.2f} (target <= 0.4); whole records {result['record_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
