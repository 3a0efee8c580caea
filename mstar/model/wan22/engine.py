"""How Wan2.2's engines are built from its knobs and checkpoint: the UMT5 prompt encoder, the DiT
as a UniPC denoise engine, and the VAE (``encode`` an i2v request's image, ``decode`` the final
latents to uint8 frames; requests of one size in one batch)."""

from __future__ import annotations

from collections import defaultdict

import torch

from mstar.config import DeploymentConfig
from mstar.engine.base import Engine, StatelessEngine
from mstar.model.diffusion_engines import text_encoder_engine
from mstar.model.wan22 import transformer
from mstar.model.wan22 import vae as wan_vae
from mstar.model.wan22.checkpoint import WanCheckpoint
from mstar.model.wan22.denoise import WanDenoiseEngine
from mstar.model.wan22.knobs import WanKnobs
from mstar.model.wan22.transformer import WanTransformer
from mstar.model.wan22.vae import WanVAE, frames_uint8

# Kept in float32 in a bf16 deployment, as diffusers keeps them (its _keep_in_fp32_modules): the
# time MLP, the modulation tables and the cross-attention norm.
FP32_PARAMETERS = ("time_embedder", "scale_shift_table", "norm2")


def wan_engines(ckpt: WanCheckpoint, knobs: WanKnobs, config: DeploymentConfig, nodes: set[str],
                device: torch.device) -> dict[str, Engine]:
    load = ckpt.loader(config, knobs.seed, device)
    dtype = config.torch_dtype()
    engines: dict[str, Engine] = {}
    if "text_encoder" in nodes:
        engines["text_encoder"] = text_encoder_engine(ckpt.text(), load)
    if "dit" in nodes:
        dit = load(lambda: WanTransformer(ckpt.transformer_config()), "transformer", 2, fp32=FP32_PARAMETERS)
        engines["dit"] = dit_engine(dit, ckpt, knobs, device, dtype)
    if "vae" in nodes:
        vae_dtype = getattr(torch, knobs.vae_dtype)
        vae = ckpt.load(lambda: WanVAE(ckpt.vae_config()), "vae", device=device, dtype=vae_dtype,
                        dummy=config.load_format == "dummy", seed=knobs.seed + 3)
        engines["vae"] = vae_engine(vae, knobs, device, vae_dtype)
    return engines


def dit_engine(dit: WanTransformer, ckpt: WanCheckpoint, knobs: WanKnobs, device: torch.device,
               dtype: torch.dtype) -> WanDenoiseEngine:
    transformer.use_fused_kernels(dit, knobs.fused_kernels)
    if knobs.compile:
        for block in dit.blocks:
            block.compile(backend=knobs.compile_backend)

    def predict(latents, time, prompt):
        # latents and the sampler stay in float32 (as the pipeline keeps them); the DiT runs in
        # the deployment dtype.
        with knobs.attention_scope():
            return dit(latents.to(dtype), time, prompt=prompt)

    def encode(text):  # the prompts' cross-attention keys and values, reused while the rows stay
        return dit.prompt_keys(text.to(dtype))

    return WanDenoiseEngine(predict, ckpt.schedule(), dit.config.patch_size, device, encode=encode,
                            **knobs.batching)


def vae_engine(vae: WanVAE, knobs: WanKnobs, device: torch.device, dtype: torch.dtype) -> StatelessEngine:
    wan_vae.use_fused_kernels(vae, knobs.fused_kernels)
    wan_vae.use_channels_last(vae, knobs.vae_channels_last and device.type == "cuda")
    decode = knobs.vae_decode(vae)

    def run(op, items):
        port = {"encode": "pixels", "decode": "latents"}.get(op)
        if port is None:
            raise ValueError(f"the Wan VAE has no op {op!r} (it has ['encode', 'decode'])")
        by_shape = defaultdict(list)
        for i, item in enumerate(items):
            by_shape[tuple(item.inputs[port].shape)].append(i)
        out = [None] * len(items)
        for rows in by_shape.values():
            x = torch.stack([items[i].inputs[port] for i in rows]).to(device, dtype)
            if op == "encode":
                results = [{"condition": z} for z in vae.normalize(vae.encode(x).float())]
            else:
                results = [{"frames": frames_uint8(v).cpu()}
                           for v in decode(vae.denormalize(x), chunk=knobs.vae_decode_chunk)]
            for i, result in zip(rows, results):
                out[i] = result
        return out

    return StatelessEngine(run)
