"""How Cosmos3's engines are built from its knobs and checkpoint: the tower as a UniPC denoise
engine (``dit``) and the Wan2.2 VAE (``vae``: ``encode`` an i2v/v2v request's conditioning
pixels to normalised latents, ``decode`` the final latents to uint8 frames, and a windowed
rollout's window ops) and, on a sound-capable checkpoint, the AVAE decoder (``sound``,
float32; ``mstar.model.cosmos3.sound``)."""

from __future__ import annotations

from collections import defaultdict

import torch

from mstar.config import DeploymentConfig
from mstar.distributed.state import current_parallel
from mstar.engine.base import Engine, StatelessEngine
from mstar.model.cosmos3.checkpoint import Cosmos3Checkpoint
from mstar.model.cosmos3.denoise import Cosmos3DenoiseEngine
from mstar.model.cosmos3.knobs import Cosmos3Knobs
from mstar.model.cosmos3.sound import sound_engine
from mstar.model.cosmos3.transformer import Cosmos3Transformer
from mstar.model.cosmos3.windowed import OPS as WINDOW_OPS
from mstar.model.cosmos3.windowed import run_window_op
from mstar.model.wan22.vae import DecodeState, WanVAE, frames_uint8

# Kept in float32 in a bf16 deployment, as diffusers keeps it (its _keep_in_fp32_modules).
FP32_PARAMETERS = ("time_embedder",)


def cosmos3_engines(ckpt: Cosmos3Checkpoint, knobs: Cosmos3Knobs, config: DeploymentConfig, nodes: set[str],
                    device: torch.device) -> dict[str, Engine]:
    if {"llm", "vision"} & nodes and not current_parallel().is_single:  # placement refuses it first
        raise ValueError("the Cosmos3-Edge reasoner (nodes llm, vision) runs at tp_size 1 and sp_size 1: "
                         "place it in a node group of its own, apart from a split dit")
    engines: dict[str, Engine] = {}
    dummy = config.load_format == "dummy"
    if {"dit", "llm"} & nodes:  # one tower for both: the reasoner reads its understanding expert
        load = ckpt.loader(config, knobs.seed, device)
        tower = load(lambda: Cosmos3Transformer(ckpt.transformer_config()), "transformer", 0, fp32=FP32_PARAMETERS)
    if "dit" in nodes:
        engines["dit"] = Cosmos3DenoiseEngine(tower, ckpt.schedule(), device, knobs.max_gen_batch_size)
    if {"llm", "vision"} & nodes:
        from mstar.model.cosmos3.reasoner import reasoner_engines

        engines.update(reasoner_engines(ckpt.root, tower if "llm" in nodes else None, nodes, config, knobs.seed,
                                        device, knobs.reasoner_attention_backend))
    if "vae" in nodes:
        dtype = getattr(torch, knobs.vae_dtype)
        vae = ckpt.load(lambda: WanVAE(ckpt.vae_config()), "vae", device=device, dtype=dtype, dummy=dummy,
                        seed=knobs.seed + 1)
        engines["vae"] = VAEEngine(vae, knobs, device, dtype)
    if "sound" in nodes and ckpt.has_sound():  # without it no request takes a sound walk
        tokenizer = ckpt.load_sound_tokenizer(device=device, dtype=torch.float32, dummy=dummy, seed=knobs.seed + 2)
        engines["sound"] = sound_engine(tokenizer, device)
    return engines


class VAEEngine(StatelessEngine):
    """The ``vae`` node's engine: ``vae_fn``, and the decoder state a ``window_mode: kv``
    rollout without a session carries from one window's decode to the next, by request, freed
    when the request ends, however it ends (a session's lives in the session store)."""

    def __init__(self, vae: WanVAE, knobs: Cosmos3Knobs, device: torch.device, dtype: torch.dtype) -> None:
        self.vae = vae
        self.decodes: dict[str, DecodeState] = {}
        super().__init__(vae_fn(vae, knobs, device, dtype, self.decodes))

    def release(self, request_id: str) -> None:
        self.decodes.pop(request_id, None)


def vae_fn(vae: WanVAE, knobs: Cosmos3Knobs, device: torch.device, dtype: torch.dtype,
           decodes: dict[str, DecodeState]):
    ops = ("encode", "decode", "decode_image", *WINDOW_OPS)

    def run(op, items):
        if op in WINDOW_OPS:  # a windowed rollout's window boundaries (mstar.model.cosmos3.windowed)
            return run_window_op(vae, op, items, dtype, device, knobs.vae_decode_chunk, decodes)
        if op not in ops:
            raise ValueError(f"the Cosmos3 VAE has no op {op!r} (it has {list(ops)})")
        port = "cond_pixels" if op == "encode" else "latents"
        by_shape = defaultdict(list)
        for i, item in enumerate(items):
            by_shape[tuple(item.inputs[port].shape)].append(i)
        out = [None] * len(items)
        with torch.inference_mode():
            for rows in by_shape.values():
                x = torch.stack([items[i].inputs[port] for i in rows]).to(device, dtype)
                if op == "encode":  # the pipeline's _encode_video: the posterior mean, normalised
                    for i, z in zip(rows, vae.normalize(vae.encode(x)).float()):
                        out[i] = {"cond_latents": z}
                    continue
                videos = vae.decode(vae.denormalize(x), chunk=knobs.vae_decode_chunk)
                for i, video in zip(rows, videos):
                    frames = frames_uint8(video).cpu()
                    out[i] = {"frames": frames} if op == "decode" else {"image": frames[0]}
        return out

    return run
