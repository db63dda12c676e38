#!/usr/bin/env python3
"""Give every JSONL record without an `instance_id` a unique, stable one.

Stable: a generated id is `<prefix><sha1 of the record's JSON>[:12]`, so running the tool again on the
same data gives the same ids; identical records are told apart by a `-<n>` occurrence suffix. Existing
ids are kept. Duplicate ids (given or generated) are refused, naming the lines. The output is written
atomically (temp file, then rename), by default to `<name>_instance_id.jsonl` beside the input.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson


class AssignError(ValueError):
    pass


def default_output(input_path: Path) -> Path:
    return input_path.with_name(f"{input_path.stem}_instance_id.jsonl")


def assign_ids(rows: list[tuple[int, dict[str, Any]]], prefix: str = "") -> list[dict[str, Any]]:
    """`rows` are (line number, record); returns the records with ids, or raises AssignError."""
    seen: dict[str, int] = {}
    occurrences: dict[str, int] = {}
    out: list[dict[str, Any]] = []
    for line_no, record in rows:
        if record.get("instance_id") in (None, ""):
            digest = hashlib.sha1(orjson.dumps(record, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]
            count = occurrences.get(digest, 0)
            occurrences[digest] = count + 1
            record = {**record, "instance_id": f"{prefix}{digest}" + (f"-{count}" if count else "")}
        instance_id = str(record["instance_id"])
        if instance_id in seen:
            raise AssignError(f"duplicate instance_id {instance_id!r} on lines {seen[instance_id]} and {line_no}")
        seen[instance_id] = line_no
        out.append(record)
    return out


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    rows: list[tuple[int, dict[str, Any]]] = []
    with path.open("rb") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise AssignError(f"line {line_no} is not valid JSON: {exc}") from exc
            if not isinstance(record, dict):
                raise AssignError(f"line {line_no} is not a JSON object")
            rows.append((line_no, record))
    return rows


def write_atomically(path: Path, records: list[dict[str, Any]]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            for record in records:
                handle.write(orjson.dumps(record) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input_path", "--input-path", required=True, type=Path)
    parser.add_argument("--output_path", "--output-path", type=Path)
    parser.add_argument("--prefix", default="", help="prefix for generated ids")
    args = parser.parse_args(argv)
    output = args.output_path or default_output(args.input_path)
    try:
        records = assign_ids(read_jsonl(args.input_path), args.prefix)
        write_atomically(output, records)
    except (AssignError, OSError) as exc:
        print(f"assign_instance_id: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(records)} records to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
