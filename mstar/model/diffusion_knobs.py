"""Deployment knobs shared by the diffusion families, and their component loader.

``DiffusionKnobs`` reads ``model_kwargs`` once, at startup, and fails naming the key:
``max_image_area`` (pixels a request may ask for), ``num_inference_steps`` (the default),
``max_batch_size`` (rows per denoise forward), ``seed`` (of dummy weights), ``compile`` and
``compile_backend`` (torch.compile of the DiT), ``vae_compile`` (torch.compile of the VAE
decode, same backend), ``attention_backend`` (``"sdpa"``: PyTorch's own choice of fused
attention, the reference; ``"cudnn"``: cuDNN's fused attention first, faster on Hopper GPUs,
the others where it cannot run), ``cuda_graphs`` (the text encoder replayed from a CUDA graph
per prompt shape, for the families whose text side supports it; CUDA only),
``fused_kernels`` (the DiT's per-head QK-norm and RoPE as one Triton kernel, for the families
that have it; CUDA only), ``lora`` (adapters folded in at load). Eager is the reference.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from mstar.model.lora import LoraAdapter, parse_adapters

MAX_STEPS = 100
ATTENTION_BACKENDS = ("sdpa", "cudnn")


class DiffusionKnobs:
    def __init__(self, kwargs: dict, default_steps: int):
        def integer(name: str, default: int | None, low: int = 1) -> int | None:
            value = kwargs.get(name, default)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"model_kwargs.{name}: must be an integer >= {low}, got {value!r}")
            return value

        self.max_area = integer("max_image_area", 2048 * 2048)
        self.default_steps = integer("num_inference_steps", default_steps)
        if self.default_steps > MAX_STEPS:
            raise ValueError(f"model_kwargs.num_inference_steps: must be at most {MAX_STEPS}")
        self.max_batch_size = integer("max_batch_size", None)
        self.seed = integer("seed", 0, low=0)
        self.compile, self.vae_compile = kwargs.get("compile", False), kwargs.get("vae_compile", False)
        self.cuda_graphs = kwargs.get("cuda_graphs", False)
        self.fused_kernels = kwargs.get("fused_kernels", False)
        for name, value in (("compile", self.compile), ("vae_compile", self.vae_compile),
                            ("cuda_graphs", self.cuda_graphs), ("fused_kernels", self.fused_kernels)):
            if not isinstance(value, bool):
                raise ValueError(f"model_kwargs.{name}: must be true or false, got {value!r}")
        self.compile_backend = kwargs.get("compile_backend", "inductor")
        compiling = self.compile or self.vae_compile
        if not isinstance(self.compile_backend, str) or (
                compiling and self.compile_backend not in torch.compiler.list_backends(exclude_tags=())):
            raise ValueError("model_kwargs.compile_backend: must name a registered torch.compile backend "
                             f"(inductor, aot_eager, cudagraphs, ...), got {self.compile_backend!r}")
        self.attention_backend = kwargs.get("attention_backend", "sdpa")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"model_kwargs.attention_backend: must be one of {list(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        self.lora: list[LoraAdapter] = parse_adapters(kwargs.get("lora"))

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


def load_component(module: torch.nn.Module, folder: Path, *, device: torch.device, dtype: torch.dtype,
                   dummy: bool, seed: int, **load) -> torch.nn.Module:
    """``module`` on ``device`` in ``dtype`` with the weights of a diffusers component folder
    (coverage checked both ways), or seeded random weights when ``dummy``; in eval mode."""
    from mstar.model.weights import init_dummy_weights, iter_safetensors, load_weights

    module = module.to(device=device, dtype=dtype)
    if dummy:
        init_dummy_weights(module, seed=seed)
    else:
        load_weights(module, iter_safetensors(folder), dtype=dtype, **load)
    return module.eval()


def text_encoder_engine(text, build, cuda_graphs: bool = False):
    """The text-encoder node of a diffusion family: ``text.build_encoder()`` loaded from the
    ``text_encoder`` folder by ``build(module, folder, seed_offset, **load)``; every request's
    prompt tokens in one batched ``text.encode(encoder, ids, masks)``, each item getting its
    ``text`` features. ``cuda_graphs``: ``text.graphed(encoder)`` replays the forward
    (``text.encode(..., graphs=...)``); the encoder must be on a CUDA device."""
    from mstar.engine.base import StatelessEngine

    encoder = text.build_encoder()
    encoder = build(encoder, "text_encoder", 1, name_map=encoder.checkpoint_name_map)
    extra = {}
    if cuda_graphs:
        if encoder.model.embed_tokens.weight.device.type != "cuda":
            raise ValueError("model_kwargs.cuda_graphs needs device: cuda")
        extra["graphs"] = text.graphed(encoder)

    return StatelessEngine(lambda op, items: [
        {"text": e} for e in text.encode(encoder, [i.inputs["prompt_ids"] for i in items],
                                         [i.inputs["prompt_mask"] for i in items], **extra)])
