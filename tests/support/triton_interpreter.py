"""Running our Triton kernels in tests, on the GPU or under Triton's CPU interpreter.

Import this before anything that imports Triton: without CUDA it sets ``TRITON_INTERPRET``
so that the kernels (and Triton's own jit'd helpers) are built for the interpreter. When
something else imported Triton first in the session (``torch._dynamo`` does, e.g. through
transformers), the kernels cannot run in this process: ``kernels_runnable`` says so, the
kernel tests skip, and ``rerun_in_fresh_interpreter`` runs the test file again in a process
of its own, so the kernel tests never silently go unrun. Skips the importing module without
Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before triton's first import: its own jit'd helpers read it too
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

REASON = "triton was imported before TRITON_INTERPRET was set: test_kernels_in_a_fresh_interpreter runs these"


def kernels_runnable(kernels: ModuleType) -> bool:
    """Whether ``kernels`` (a module of ours with an ``INTERPRET`` flag) can run here:
    compiled on CUDA, or interpreted on the CPU with Triton itself interpreted too."""
    interpreted = type(triton.language.zeros).__name__ == "InterpretedFunction"
    return DEVICE.type == "cuda" or (kernels.INTERPRET and interpreted)


def rerun_in_fresh_interpreter(test_file: str, *, allow_skips: bool = False) -> None:
    """Run ``test_file``'s other tests in a new process with the interpreter on; they must
    pass (and, unless ``allow_skips``, none may skip)."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not fresh_interpreter",
         str(Path(test_file).resolve())],
        cwd=root, env=os.environ | {"TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout, result.stdout[-2000:]
    assert allow_skips or "skipped" not in result.stdout, result.stdout[-2000:]


def index_interpreted_scalars() -> None:
    """Under NumPy >= 2.4 the interpreter's 1-element arrays (scalar loop bounds) refuse
    ``int()``: give its tensors an ``__index__`` that reads their element. Once a process."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "indexes_scalars", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.indexes_scalars = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
