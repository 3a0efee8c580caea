"""How Z-Image's engines are built from its knobs and checkpoint: the caption encoder, the DiT
as a denoise engine (LoRA folded in, its blocks compiled, in the knobs' attention scope) and
the VAE decoder (the requests of one size in one batch).

``compile`` compiles the transformer blocks, not the whole DiT: the blocks see padded
``[rows, tokens, dim]`` batches whose token counts are multiples of 32, so a few traces cover
every request, while the ragged per-request work around them (patches, caption padding,
rotary tables) stays eager.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from mstar.config import DeploymentConfig
from mstar.engine.base import Engine, StatelessEngine
from mstar.engine.denoise import DenoiseEngine
from mstar.model.diffusion_engines import text_encoder_engine
from mstar.model.z_image.checkpoint import ZImageCheckpoint
from mstar.model.z_image.knobs import ZImageKnobs
from mstar.model.z_image.lora_layout import fold_z_image_adapters
from mstar.model.z_image.transformer import ZImageTransformer
from mstar.model.z_image.vae import ZImageVAE


def z_image_engines(ckpt: ZImageCheckpoint, knobs: ZImageKnobs, config: DeploymentConfig, nodes: set[str],
                    device: torch.device) -> dict[str, Engine]:
    dtype = config.torch_dtype()

    load = ckpt.loader(config, knobs.seed, device)

    engines: dict[str, Engine] = {}
    if "text_encoder" in nodes:
        engines["text_encoder"] = text_encoder_engine(ckpt.text(), load)
    if "dit" in nodes:
        dit = load(lambda: ZImageTransformer(ckpt.transformer_config()), "transformer", 2)
        engines["dit"] = dit_engine(dit, ckpt, knobs, device, dtype)
    if "vae" in nodes:
        engines["vae"] = vae_engine(load(lambda: ZImageVAE(ckpt.vae_config()), "vae", 3), knobs, device, dtype)
    return engines


def dit_engine(dit: ZImageTransformer, ckpt: ZImageCheckpoint, knobs: ZImageKnobs, device: torch.device,
               dtype: torch.dtype) -> DenoiseEngine:
    fold_z_image_adapters(dit, knobs.lora)  # in fp32, one rounding per weight
    if knobs.compile:
        for block in (*dit.noise_refiner, *dit.context_refiner, *dit.layers):
            block.compile(backend=knobs.compile_backend)

    def velocity(latents, text, t, params):
        # The engine keeps latents, captions and time in float32 (as the pipeline does);
        # the DiT runs in the deployment dtype and predicts the negated velocity.
        captions = [row[: p["caption_len"]].to(dtype) for row, p in zip(text, params)]
        with knobs.attention_scope():
            return -dit(latents.to(dtype), t, captions)

    return DenoiseEngine(velocity, ckpt.schedule(), device, torch.float32, **knobs.batching)


def vae_engine(vae: ZImageVAE, knobs: ZImageKnobs, device: torch.device, dtype: torch.dtype) -> StatelessEngine:
    vae_decode = knobs.vae_decode(vae)

    def decode(op, items):
        by_size = defaultdict(list)
        for i, item in enumerate(items):
            by_size[tuple(item.inputs["latents"].shape)].append(i)
        out = [None] * len(items)
        for rows in by_size.values():
            latents = torch.stack([items[i].inputs["latents"] for i in rows]).to(device, dtype)
            images = vae_decode(vae.denormalize(latents)).float().cpu()
            for i, image in zip(rows, images):
                out[i] = {"image": image}
        return out

    return StatelessEngine(decode)
