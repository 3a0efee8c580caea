"""Our own CPU kernels (``mstar/layers/csrc``), built on the machine that runs them.

The block-quantised products of ``mstar.layers.quantized`` (``BlockInt4Weight``,
``BlockInt8Weight``) run on ``csrc/block_gemm.cpp``: compiled the first time a process needs
it, with the machine's own vector instructions (``-march=native``), against the installed
torch, and cached under ``$MSTAR_KERNEL_CACHE`` (default ``~/.cache/mstar/kernels``) keyed by
the source, the torch version, the compiler and the CPU's feature flags, so a later start
loads it in milliseconds. The build takes ~10 s on 2 cores; concurrent builds (several
worker processes starting at once) each write their own file and move it into place.

Where the build cannot happen (no C++ compiler, not Linux, ``MSTAR_NATIVE_KERNELS=0``) or
fails, ``native_kernels()`` is False once, with the reason logged, and the quantised weights
fall back to PyTorch's kernels (``Int4Weight``, ``SplitInt8Weight``).

Threads: the kernel splits its output tiles with ``at::parallel_for``, torch's own OpenMP
pool; the library links the OpenMP runtime this process already loaded (read from
``/proc/self/maps``), so the two never run two thread pools side by side.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

__all__ = ["kernel_cache_dir", "native_kernels"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "block_gemm.cpp"
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-fPIC", "-shared", "-w")


def kernel_cache_dir() -> Path:
    """Where built kernels are kept (``$MSTAR_KERNEL_CACHE``, else ``~/.cache/mstar/kernels``)."""
    root = os.environ.get("MSTAR_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "mstar" / "kernels"


def _openmp_runtime() -> str | None:
    """The path of the OpenMP runtime torch loaded into this process, if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    found = re.findall(r"(/\S*lib(?:gomp|iomp5|omp)[^/\s]*\.so[^/\s]*)", maps)
    return found[0] if found else None


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    match = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE)
    return match.group(1).strip() if match else ""


def _build(compiler: str, target: Path, openmp: str | None) -> None:
    include = Path(torch.__file__).parent / "include"
    lib = Path(torch.__file__).parent / "lib"
    command = [compiler, *_FLAGS, *(["-fopenmp"] if openmp else []),
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", str(_SOURCE),
               f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", *([openmp] if openmp else [])]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        done = subprocess.run([*command, "-o", str(built)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(built, target)


@cache
def native_kernels() -> bool:
    """Whether ``torch.ops.mstar_cpu`` (our CPU kernels) is loaded in this process, building
    it first where needed; False (logged once) where it cannot be."""
    if os.environ.get("MSTAR_NATIVE_KERNELS", "1") == "0":
        log.info("native CPU kernels off (MSTAR_NATIVE_KERNELS=0): PyTorch's quantised kernels instead")
        return False
    if not sys.platform.startswith("linux"):
        log.info("native CPU kernels are built on Linux only: PyTorch's quantised kernels instead")
        return False
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        log.warning("no C++ compiler (CXX, c++, g++): the quantised products use PyTorch's slower kernels")
        return False
    openmp = _openmp_runtime() if torch.__config__.parallel_info().find("OpenMP") >= 0 else None
    key = hashlib.sha256("\n".join([
        _SOURCE.read_text(), torch.__version__, compiler, str(openmp), " ".join(_FLAGS), _cpu_flags(),
    ]).encode()).hexdigest()[:16]
    target = kernel_cache_dir() / f"block_gemm-{key}.so"
    try:
        if not target.exists():
            log.info("building the native CPU kernels (%s, once per machine) into %s", compiler, target)
            _build(compiler, target, openmp)
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("native CPU kernels unavailable, PyTorch's quantised kernels instead: %s", error)
        return False
    _register_fakes()
    return True


def _register_fakes() -> None:
    """Shapes of the ops for ``torch.compile``'s tracing (the graphs call the kernels as they are)."""
    def fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *rest: object) -> torch.Tensor:
        out_features = rest[-1]
        return x.new_empty((x.shape[0], out_features), dtype=torch.float32)

    for op in ("mstar_cpu::int4_block_mm", "mstar_cpu::int8_block_mm"):
        torch.library.register_fake(op)(fake)
