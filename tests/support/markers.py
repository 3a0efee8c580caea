"""The one GPU marker: ``@needs_cuda`` (one GPU), ``@needs_cuda(count=2)``,
``@needs_cuda(triton=True)``. It is ``pytest.mark.gpu``; tests/conftest.py skips what this
machine cannot run."""

from __future__ import annotations

import pytest

needs_cuda = pytest.mark.gpu
