"""How FLUX.2 [klein]'s engines are built from its knobs and checkpoint: the text encoder
(optionally replayed from CUDA graphs), the DiT as a denoise engine (LoRA folded in, fused
QK-norm + RoPE, compiled, in the knobs' attention scope) and the VAE (decode, and encode for
reference images)."""

from __future__ import annotations

import torch

from mstar.config import DeploymentConfig
from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.engine.base import Engine, StatelessEngine
from mstar.model.diffusion_engines import text_encoder_engine
from mstar.model.flux2.checkpoint import Flux2Checkpoint
from mstar.model.flux2.edit import ReferenceDenoiseEngine, encode_references
from mstar.model.flux2.knobs import Flux2Knobs
from mstar.model.flux2.lora_layout import flux2_lora_targets
from mstar.model.flux2.positions import DeviceIds
from mstar.model.flux2.transformer import Flux2Transformer, use_fused_qk_norm_rope
from mstar.model.flux2.vae import Flux2VAE, unpack_latents
from mstar.model.image_output import to_pixels
from mstar.model.lora import fold_adapters


def flux2_engines(ckpt: Flux2Checkpoint, knobs: Flux2Knobs, config: DeploymentConfig, nodes: set[str],
                  device: torch.device) -> dict[str, Engine]:
    dtype = config.torch_dtype()

    load = ckpt.loader(config, knobs.seed, device)

    engines: dict[str, Engine] = {}
    if "text_encoder" in nodes:
        engines["text_encoder"] = text_encoder_engine(ckpt.text(), load, knobs.cuda_graphs)
    if "dit" in nodes:
        dit = load(lambda: Flux2Transformer(ckpt.transformer_config()), "transformer", 2)
        engines["dit"] = dit_engine(dit, knobs, device, dtype)
    if "vae" in nodes:
        engines["vae"] = vae_engine(load(lambda: Flux2VAE(ckpt.vae_config()), "vae", 3), knobs, device, dtype)
    return engines


def dit_engine(dit: Flux2Transformer, knobs: Flux2Knobs, device: torch.device,
               dtype: torch.dtype) -> ReferenceDenoiseEngine:
    fold_adapters(dit, knobs.lora, targets=flux2_lora_targets)  # in fp32, one rounding per weight
    if knobs.fused_kernels:
        use_fused_qk_norm_rope(dit)
    forward = torch.compile(dit, backend=knobs.compile_backend) if knobs.compile else dit
    device_ids = DeviceIds(device)

    def velocity(latents, text, t, params):
        ids, txt_ids = device_ids(params, text.shape[1])
        with knobs.attention_scope():
            return forward(latents, text, t, ids, txt_ids, guidance=None)

    return ReferenceDenoiseEngine(velocity, FlowMatchEuler(), device, dtype, **knobs.batching)


def vae_engine(vae: Flux2VAE, knobs: Flux2Knobs, device: torch.device, dtype: torch.dtype) -> StatelessEngine:
    decode = knobs.vae_decode(vae)

    def run(op, items):
        out = []
        for item in items:  # sizes differ between requests; one at a time
            p = item.params
            if op == "encode":
                tokens = encode_references(vae, item.inputs["reference_pixels"], p["reference_sizes"])
                out.append({"references": tokens})
                continue
            latents = item.inputs["latents"][None].to(device, non_blocking=True).to(dtype)
            latents = unpack_latents(latents, p["rows"], p["cols"], *vae.latent_norm())
            out.append({"image": to_pixels(decode(latents)[0])})
        # every decode queued before the first copy to the host: the one wait for the GPU
        return [{"image": o["image"].cpu()} if "image" in o else o for o in out]

    return StatelessEngine(run)
