"""Property-based fuzzing of the write routes over the OpenAPI schema (schemathesis): the part of
tests/api/test_fuzz_api.py's fuzzing that costs the most, in a file of its own so it runs beside the rest.

The fuzzing itself, the server and the properties checked are in tests/support/fuzz_api.py.
"""

from __future__ import annotations

import pytest

from tests.support.fuzz_api import Fuzzed, check_the_target_run_survived, check_with_the_token, \
    check_without_the_token, fuzzed, ids, operations  # noqa: F401  (fuzzed: the module's server fixture)

OPERATIONS = operations("writes")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=ids(OPERATIONS))
def test_no_route_answers_5xx_and_refusals_store_nothing(fuzzed: Fuzzed, method: str, path: str) -> None:
    check_with_the_token(fuzzed, method, path)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=ids(OPERATIONS))
def test_without_the_token_every_route_but_health_is_401(fuzzed: Fuzzed, method: str, path: str) -> None:
    check_without_the_token(fuzzed, method, path)


def test_the_target_run_survived(fuzzed: Fuzzed) -> None:
    check_the_target_run_survived(fuzzed)
