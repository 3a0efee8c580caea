"""The deployment knobs of the diffusion families (``DiffusionKnobs``), typed like every
family's (``mstar.model.knobs``): a family subclasses it with its default step count and the
switches it implements (klein's ``cuda_graphs`` and ``fused_kernels``, klein base's guidance).

``attention_backend``: ``sdpa`` is PyTorch's own choice of fused attention, the reference;
``cudnn`` puts cuDNN's fused attention first (faster on Hopper GPUs) and the others where it
cannot run. ``compile`` compiles the DiT and ``vae_compile`` the VAE decode, both with
``compile_backend``. Eager is the reference.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, field_validator

from mstar.model.knobs import Compile
from mstar.model.lora import LoraAdapter, parse_adapters

MAX_STEPS = 100
Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]  # a family's default ``num_inference_steps``


class DiffusionKnobs(Compile):
    max_image_area: int = Field(2048 * 2048, ge=1)
    """The largest ``width * height`` a request may ask for; larger is a 400 before scheduling."""

    num_inference_steps: Steps
    """The step count of requests that do not send one (each family sets its default)."""

    max_batch_size: int | None = Field(None, ge=1)
    """DiT rows per forward (a guided request is two); None: no bound."""

    vae_compile: bool = False
    """``torch.compile`` the VAE decode, with ``compile_backend``."""

    attention_backend: Literal["sdpa", "cudnn"] = "sdpa"
    """The DiT's fused attention kernels: ``sdpa`` (PyTorch's choice) or ``cudnn`` first."""

    lora: list[LoraAdapter] = Field(default_factory=list)
    """Adapters folded into the DiT weights at load: ``[{path, scale}]`` (``mstar.model.lora``)."""

    @field_validator("lora", mode="plain")
    @classmethod
    def _adapters(cls, value: Any) -> list[LoraAdapter]:
        return parse_adapters(value)

    @property
    def compiles(self) -> bool:
        return self.compile or self.vae_compile

    def attention_scope(self):
        """The context a DiT forward runs in: which fused attention kernels its
        ``scaled_dot_product_attention`` calls may take (a compiled DiT fixes the choice when
        it is traced, so the scope wraps the compiled call too)."""
        if self.attention_backend == "sdpa":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        return sdpa_kernel(order, set_priority=True)

    def vae_decode(self, vae: torch.nn.Module):
        """The VAE's ``decode``, compiled when ``vae_compile`` is on."""
        return torch.compile(vae.decode, backend=self.compile_backend) if self.vae_compile else vae.decode

    @property
    def batching(self) -> dict:
        """Keyword arguments of the denoise engine: ``max_batch_size`` when it is set."""
        return {} if self.max_batch_size is None else {"max_batch_size": self.max_batch_size}
