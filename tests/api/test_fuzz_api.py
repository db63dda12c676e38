"""Property-based fuzzing of every route over the OpenAPI schema (schemathesis): the run, trainer and status
routes here; the write routes in test_fuzz_api_writes.py, the gateway's in test_fuzz_api_gateway.py.

The fuzzing itself, the server and the properties checked are in tests/support/fuzz_api.py.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.fuzz_api import OPERATIONS as EVERY_OPERATION, PARTS, fuzz_tests, fuzzed, part_of  # noqa: F401

(test_no_route_answers_5xx_and_refusals_store_nothing, test_without_the_token_every_route_but_health_is_401,
 test_the_target_run_survived) = fuzz_tests("control")


def test_every_route_is_fuzzed_in_one_of_the_files() -> None:
    """Each part has its file (this one and the two beside it), so every route of the schema is fuzzed."""
    here = Path(__file__).parent
    files = {"control": here / "test_fuzz_api.py", "writes": here / "test_fuzz_api_writes.py",
             "gateway": here / "test_fuzz_api_gateway.py"}
    assert set(files) == set(PARTS) and all(f.exists() for f in files.values())
    assert all(f'fuzz_tests("{part}")' in files[part].read_text() for part in PARTS)
    assert {part_of(*op) for op in EVERY_OPERATION} == set(PARTS)
    assert len(EVERY_OPERATION) > 20 and ("POST", "/buffer/write") in EVERY_OPERATION
