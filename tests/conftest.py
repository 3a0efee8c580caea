"""Suite-wide test set-up: the markers' meaning (registered in pyproject.toml).

- ``gpu`` (``tests.support.markers.needs_cuda``): needs CUDA GPUs, ``count`` of them (default
  1), and Triton when ``triton=True``; skipped here without them, before any fixture runs.
- ``e2e``: a whole deployment or a served HTTP API (every test under tests/e2e gets it).
- ``slow``: over about ten seconds on a 2-core machine.

``make test-fast`` runs ``-m "not e2e and not slow"``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# The suite runs two test processes on two cores, and many tests start servers whose workers
# take a thread per core: far more OpenMP threads than cores. GNU OpenMP's threads spin while
# waiting for work by default, and spinning threads that outnumber the cores starve the ones
# with work (a replicas test: 42 s under load, 6 s with passive waits). libgomp reads this when
# it loads, with torch: set before the import, and inherited by every server a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton reads this once, at its first import: set here, before any test module can import
    # it (torch._dynamo does, e.g. through transformers), the kernel tests run in-process under
    # the interpreter (tests/support/triton_interpreter.py) and need no fresh-interpreter rerun.
    os.environ.setdefault("TRITON_INTERPRET", "1")

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def missing_gpu(count: int = 1, triton: bool = False) -> str | None:
    """Why a test needing ``count`` GPUs (and Triton) cannot run here, or None."""
    have = torch.cuda.device_count()  # 0 without CUDA; initialises no device
    if have < count:
        return f"needs {count} CUDA GPU(s), this machine has {have}"
    if triton and importlib.util.find_spec("triton") is None:
        return "needs CUDA and triton"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(item.path).parents:
            item.add_marker(pytest.mark.e2e)
        mark = item.get_closest_marker("gpu")
        if mark is not None:
            reason = missing_gpu(*mark.args, **mark.kwargs)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
