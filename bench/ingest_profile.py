"""Where an ingest write's time goes: the ingest benchmark's `/buffer/write` load (64 clients, realistic
~77 KB records) against one server, sampled by py-spy, and the server's samples sorted into parts.

    py-spy record --subprocesses --format raw -r 200 -o ingest.txt -- python -m bench.ingest_profile
    python -m bench.ingest_profile --fold ingest.txt

(`--format speedscope -o ingest.json` instead gives a profile to open in speedscope.app; `--native` adds
C frames, from which `--fold` also reports the share spent freeing memory.) The load runs only single JSON
writes, so every busy server sample belongs to them; the driver's own samples are left out.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench.ingest import _bodies
from bench.load import drive

# (part, markers): a sample belongs to the first part one of whose markers appears in its stack
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("packing the arrays", ("rollout_buffer/wire/packing.py",)),
    ("simdjson parse into numpy", ("rollout_buffer/wire/record_parsing.py",)),
    ("pydantic validation (the fields other than turns)", ("pydantic/",)),
    ("Redis write script and its round trip", ("rollout_buffer/store/store.py", "redis/")),
    ("reading the request body", ("parse_body_with", "Request.body", "Request.stream",
                                  "_body (rollout_buffer/api/fast_write")),
    ("answer serialisation", ("rollout_buffer/api/responses.py", "Response.__init__", "serialize_response")),
    ("HTTP stack (uvicorn, starlette, fastapi routing)", ("uvicorn/", "starlette/", "fastapi/", "httptools")),
    ("event loop in C (uvloop: socket reads and writes) and the rest", ("",)),
)
# native frames (py-spy --native) where memory is given back
FREEING = re.compile(r"dealloc|_PyObject_Free|\bfree \(|munmap|_int_free|PyDataMem_UserFREE")


def fold(path: Path) -> dict[str, float]:
    """Share of the server process's busy samples per part, from a py-spy raw (collapsed) profile; with
    native frames also `freeing`: the share of samples inside a deallocation or `free`, whatever part."""
    parts: Counter[str] = Counter()
    freeing = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if len(frames) < 2 or "rollout_buffer.cli serve" not in frames[1]:
            continue  # the load driver
        body = ";".join(frames[2:])
        if "_find_and_load" in body or "lifespan" in body:
            continue  # start-up
        if "concurrent/futures/thread.py" in body and "_WorkItem.run" not in body:
            continue  # an idle thread-pool thread waiting for work
        body = body.rpartition("Runner.run (")[2]  # what the event loop runs (uvicorn.run lies beneath it all)
        part = next(name for name, markers in PARTS if any(m in body for m in markers))
        parts[part] += int(count)
        freeing += int(count) if FREEING.search(body) else 0
    total = sum(parts.values()) or 1
    shares = {name: parts[name] / total for name, _ in PARTS}
    if freeing:
        shares["freeing (native frames, across the parts above)"] = freeing / total
    return shares


def run(count: int, rounds: int) -> None:
    from tests.support.helpers import ServerProcess, write_jsonl

    tasks = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tasks"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        input_file = write_jsonl(work / "in.jsonl", [{"instance_id": "x"}])
        with ServerProcess(work / "data", "--task-dir", str(tasks), "--workers", "0") as server:
            import httpx

            run_id = httpx.post(f"{server.url}/start_rollout", json={
                "task_type": "external", "input_file": str(input_file), "num_repeat_per_sample": 8,
                "run_id": "profile-ingest"}, timeout=30).json()["run_id"]
            for n in range(rounds):
                seconds = asyncio.run(drive(f"{server.url}/buffer/write", _bodies(count, run_id, f"r{n}")))
                print(f"round {n}: {count / seconds:.0f} rec/s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fold", type=Path, help="sort a py-spy raw profile of this driver into parts")
    parser.add_argument("--records", type=int, default=3072)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.fold:
        for name, share in fold(args.fold).items():
            print(f"{share * 100:5.1f}%  {name}")
        return 0
    run(args.records, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
