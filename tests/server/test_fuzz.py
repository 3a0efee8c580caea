"""Fuzzing: schemathesis generates requests from /openapi.json (valid ones and ones that
break the schema) for every operation of an app over a fake backend with every capability,
and no response may be a 5xx. Bounded: a few examples per operation, no shrinking, a
deadline for the whole run."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, Phase, settings

schemathesis = pytest.importorskip("schemathesis")
from fuzz_backend import EveryCapabilityBackend  # noqa: E402
from schemathesis.specs.openapi.checks import ignored_auth  # noqa: E402,F401 - proves the API we pin

from mstar.server.app import create_app  # noqa: E402

EXAMPLES_PER_OPERATION = 15  # 11 operations: at most ~165 requests
BUDGET_S = 60.0

app = create_app(EveryCapabilityBackend())
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
_started = time.monotonic()


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_no_request_makes_a_5xx(case) -> None:
    if time.monotonic() - _started > BUDGET_S:
        pytest.skip(f"the fuzzing budget of {BUDGET_S:.0f} s is spent")
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:  # an error has OpenAI's body naming what went wrong
        error = response.json()["error"]
        assert error["message"] and error["type"], error
