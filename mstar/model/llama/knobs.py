"""The Llama family's deployment knobs: the shared decode engine's, weight quantisation, and
``compile`` for the CPU step."""

from __future__ import annotations

import os
import shutil
import sys

from mstar.config import ConfigError
from mstar.model.knobs import Compile, DecodeKnobs, Quantization


class LlamaKnobs(DecodeKnobs, Quantization, Compile):
    """``DecodeKnobs`` plus ``quantization`` (CPU, weight-only; see ``mstar.model.quantize``)
    and ``compile``: the decode step as ``torch.compile``d graphs (a one-group decode step as
    one graph; ``LlamaForCausalLM.use_compile``), on the CPU only (CUDA's fast paths are
    ``cuda_graphs`` and ``fused_kernels``)."""

    def check(self, device: str) -> None:
        super().check(device)
        if self.compile and device != "cpu":
            raise ConfigError("model_kwargs.compile: compiles the CPU decode step; on CUDA use cuda_graphs "
                              "and fused_kernels")
        if self.compile and self.compile_backend == "inductor" and cpp_compiler() is None:
            raise ConfigError("model_kwargs.compile: inductor builds the CPU step's kernels with a C++ compiler and "
                              "none was found (set CXX or put g++ on PATH), or leave compile off")


def cpp_compiler() -> str | None:
    """The path of the C++ compiler inductor would call on this machine (``$CXX``, else
    ``g++``; ``clang++`` on macOS), or None when there is none: checked at start-up, so that
    a missing compiler is a config error naming the knob rather than a failure inside the
    warm-up's first trace."""
    return shutil.which(os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++"))
