"""The Llama family's deployment knobs: the shared decode engine's, weight quantisation, and
``compile`` for the CPU step."""

from __future__ import annotations

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
