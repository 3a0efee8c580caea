"""Shared fixtures of the CosyVoice3 tests: the reference recordings (``record_reference.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def reference() -> dict:
    return torch.load(FIXTURES / "reference.pt")
