"""Property-based fuzzing of the gateway's routes over the OpenAPI schema (schemathesis): sessions and the model
endpoints, in a file of its own so it runs beside the rest of tests/api/test_fuzz_api.py's fuzzing.

The fuzzing itself, the server and the properties checked are in tests/support/fuzz_api.py.
"""

from __future__ import annotations

from tests.support.fuzz_api import fuzz_tests, fuzzed  # noqa: F401  (fuzzed: the module's server fixture)

(test_no_route_answers_5xx_and_refusals_store_nothing, test_without_the_token_every_route_but_health_is_401,
 test_the_target_run_survived) = fuzz_tests("gateway")
