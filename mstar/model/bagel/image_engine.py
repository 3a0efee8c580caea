"""The engines of BAGEL's image walks: the generator (the MoT LLM's generation side over a
paged KV cache of its own) and the VAE.

Generator ops (ports in brackets):

- ``context`` [prompt_ids, latents, and for an edit image, image_noise and vision_embeds (the
  vision node's) -> latents]:
  builds the request's three contexts (``mstar.model.bagel.flow``): full, without the text,
  without the input image. The KV pages for each, the flow queries' scratch slots included,
  are reserved up front; when the pool cannot hold them the step is preempted (sent again
  later) rather than failed. ``latents`` (the initial noise tokens) pass through.
- ``step`` [latents -> latents]: Euler step ``iteration`` of the request's schedule. Every
  variant of every request in the batch runs in one forward of the LLM.

``attention_backend`` (the family's knob) names the paged attention of both ops: ``torch``
(the reference) or ``triton`` (``mstar.layers.triton_attention``). The Triton prefill kernel
masks each query by its mask position as the torch path does, so an image's tokens, which all
share the image's last position, attend both ways within it.

Request params: ``height``, ``width`` (pixels), ``num_timesteps`` (the schedule's points; the
walk loops ``num_timesteps - 1`` steps), ``timestep_shift`` and the guidance
(``cfg_text_scale``, ``cfg_img_scale``, ``cfg_interval``, ``cfg_renorm_type``,
``cfg_renorm_min``). ``release`` frees a request's pages.

VAE ops: ``encode`` is the generator's (an edit's latents are part of its context build);
``decode`` [latents -> image]: latent tokens -> ``uint8 [H, W, 3]`` pixels.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.engine.base import Engine, EngineItem, EngineOutput, StatelessEngine
from mstar.engine.page_pool import PagePool
from mstar.layers.paged_kv import ATTENTION_BACKENDS, allocate_kv_cache
from mstar.model.bagel.flow import (
    FlowQuery,
    ImageContexts,
    KVContext,
    MoTLanguageModel,
    Segment,
    extend,
    flow_velocities,
    guided_velocity,
    image_segment,
    latent_segment,
    step_queries,
    text_segment,
)
from mstar.model.bagel.generation import (
    CfgOptions,
    LatentProjections,
    latent_grid,
    latent_position_ids,
    patchify_latent,
    timestep_schedule,
    unpatchify_latent,
)
from mstar.model.bagel.prompt import SpecialTokens
from mstar.model.bagel.vae import decode, encode
from mstar.model.image_output import to_pixels
from mstar.model.z_image.vae import ZImageVAE

CONTEXT, STEP = "context", "step"
VARIANTS = ("full", "no_text", "no_image")


def cfg_options(params: dict) -> CfgOptions | None:
    """The guidance of a request's params; ``None`` when there is none (text scale <= 1)."""
    if float(params.get("cfg_text_scale", 1.0)) <= 1.0:
        return None
    return CfgOptions(text_scale=float(params["cfg_text_scale"]), img_scale=float(params.get("cfg_img_scale", 1.0)),
                      interval=tuple(params.get("cfg_interval", (0.4, 1.0))),
                      renorm_type=params.get("cfg_renorm_type", "global"),
                      renorm_min=float(params.get("cfg_renorm_min", 0.0)))


@dataclass
class _Job:
    contexts: ImageContexts
    position_ids: torch.Tensor
    times: torch.Tensor
    steps: torch.Tensor
    cfg: CfgOptions | None


class BagelImageEngine(Engine):
    def __init__(self, llm: MoTLanguageModel, proj: LatentProjections, vae: ZImageVAE, tokens: SpecialTokens, *,
                 num_pages: int, page_size: int, device: torch.device, dtype: torch.dtype,
                 attention_backend: str = "torch") -> None:
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}; expected one of {ATTENTION_BACKENDS}")
        self.llm, self.proj, self.vae, self.tokens = llm, proj, vae, tokens
        self.backend = attention_backend
        self.device, self.dtype, self.page_size = device, dtype, page_size
        self.downsample = vae.config.scale_factor * proj.patch_size  # pixels per latent token side
        layers, heads, head_dim = llm.cache_shape()
        self.kv = allocate_kv_cache(layers, num_pages, page_size, heads, head_dim, dtype, device)
        self.pool = PagePool(num_pages, page_size)
        self.jobs: dict[str, _Job] = {}

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        for item in items:
            if item.op not in (CONTEXT, STEP):
                raise ValueError(f"the BAGEL generator has no op {item.op!r} (it has {[CONTEXT, STEP]})")
        outputs: list[EngineOutput | None] = [None] * len(items)
        with torch.inference_mode():
            contexts = [i for i, item in enumerate(items) if item.op == CONTEXT]
            for i, out in zip(contexts, self._contexts([items[i] for i in contexts])):
                outputs[i] = out
            steps = [i for i, item in enumerate(items) if item.op == STEP]
            for i, out in zip(steps, self._steps([items[i] for i in steps])):
                outputs[i] = out
        return outputs  # type: ignore[return-value]

    # ---------------------------------------------------------------- contexts
    def _lengths(self, item: EngineItem) -> dict[str, int]:
        """Each context's tokens, from the inputs' shapes (before anything is computed: a
        context op the pool cannot hold yet costs nothing)."""
        text = item.inputs["prompt_ids"].shape[0] + 2
        if "image" not in item.inputs:
            return {"full": text, "no_text": 0}
        h, w = latent_grid(item.inputs["image"].shape[1], item.inputs["image"].shape[2], self.downsample)
        seen = h * w + 2
        if "vision_embeds" in item.inputs:
            seen += item.inputs["vision_embeds"].shape[0] + 2
        return {"full": seen + text, "no_text": seen, "no_image": text}

    def _segments(self, item: EngineItem) -> dict[str, list[Segment]]:
        """Each context's segments, in order (BAGEL's inferencer: the image as VAE latents,
        then as ViT tokens, then the text; the text-dropped context stops before the text,
        the image-dropped one has the text only)."""
        text = text_segment(self.llm, item.inputs["prompt_ids"].tolist(), self.tokens)
        if "image" not in item.inputs:
            return {"full": [text], "no_text": []}
        image = item.inputs["image"].to(self.device, self.dtype)
        h, w = latent_grid(image.shape[1], image.shape[2], self.downsample)
        noise = item.inputs["image_noise"].to(self.device, self.dtype)
        latent = patchify_latent(encode(self.vae, image[None], noise[None])[0], h, w)
        pos = latent_position_ids(h, w, self.proj.latent_pos_embed.max_latent_size)
        seen = [latent_segment(self.llm, self.proj, latent, 0.0, pos, self.tokens)]
        vit = item.inputs.get("vision_embeds")  # the vision node's output
        if vit is not None:
            seen.append(image_segment(self.llm, vit.to(self.device, self.dtype), self.tokens, generation=False))
        return {"full": [*seen, text], "no_text": seen, "no_image": [text]}

    def _contexts(self, items: list[EngineItem]) -> list[EngineOutput]:
        outputs, built = [], []
        for item in items:
            h, w = latent_grid(int(item.params["height"]), int(item.params["width"]), self.downsample)
            query = h * w + 2  # a flow step's tokens, in scratch slots past the context
            need = {v: n + query for v, n in self._lengths(item).items()}
            if not self._reserve(item.request_id, need):
                outputs.append(EngineOutput(preempted=True))
                continue
            segments = self._segments(item)
            ctx = {v: KVContext(self.pool.page_table(_seq(item.request_id, v))) for v in segments}
            times, steps = timestep_schedule(int(item.params["num_timesteps"]),
                                             float(item.params.get("timestep_shift", 3.0)))
            position_ids = latent_position_ids(h, w, self.proj.latent_pos_embed.max_latent_size).to(self.device)
            self.jobs[item.request_id] = _Job(ImageContexts(ctx["full"], ctx["no_text"], ctx.get("no_image")),
                                              position_ids, times, steps, cfg_options(item.params))
            built.append((ctx, segments))
            outputs.append(EngineOutput({"latents": item.inputs["latents"]}))
        # One forward per segment index: each context's first segments together, then the next.
        depth = max((len(segs) for _, segments in built for segs in segments.values()), default=0)
        for k in range(depth):
            rows = [(ctx[v], segs[k]) for ctx, segments in built for v, segs in segments.items() if k < len(segs)]
            extend(self.llm, self.kv, self.page_size, rows, self.backend)
        return outputs

    def _reserve(self, request_id: str, need: dict[str, int]) -> bool:
        pages = sum(self.pool.pages_needed(n) for n in need.values())
        if pages > self.pool.num_pages:
            raise ValueError(f"request {request_id}: its contexts need {pages} KV pages, the generator has "
                             f"{self.pool.num_pages}")
        if pages > self.pool.num_free_pages:
            return False
        for variant, n in need.items():
            self.pool.reserve(_seq(request_id, variant), n)
        return True

    # ---------------------------------------------------------------- steps
    def _steps(self, items: list[EngineItem]) -> list[EngineOutput]:
        if not items:
            return []
        per_item: list[list[FlowQuery]] = []
        for item in items:
            job = self.jobs[item.request_id]
            x = item.inputs["latents"].to(self.device, torch.float32)
            per_item.append(step_queries(job.contexts, x, float(job.times[item.iteration]), job.position_ids,
                                         job.cfg))
        velocities = flow_velocities(self.llm, self.proj, self.kv, self.page_size,
                                     [q for qs in per_item for q in qs], self.tokens, self.backend)
        outputs, start = [], 0
        for item, queries in zip(items, per_item):
            job = self.jobs[item.request_id]
            v = guided_velocity(velocities[start:start + len(queries)], job.cfg)
            start += len(queries)
            outputs.append(EngineOutput({"latents": queries[0].x - v * job.steps[item.iteration]}))
        return outputs

    def release(self, request_id: str) -> None:
        self.jobs.pop(request_id, None)
        for variant in VARIANTS:
            if self.pool.has(_seq(request_id, variant)):
                self.pool.free(_seq(request_id, variant))

    def stats(self) -> dict[str, float]:
        return {"generator_kv_pages_used": float(self.pool.num_used_pages)}


def _seq(request_id: str, variant: str) -> str:
    return f"{request_id}/{variant}"


def vae_decode_engine(vae: ZImageVAE, device: torch.device, dtype: torch.dtype,
                      patch_size: int = 2) -> StatelessEngine:
    """``decode`` [latents -> image]: each request's latent tokens (``params`` ``height`` and
    ``width``) -> ``uint8 [H, W, 3]``; the requests of one size in one batch."""
    downsample = vae.config.scale_factor * patch_size

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, item in enumerate(items):
            size = latent_grid(int(item.params["height"]), int(item.params["width"]), downsample)
            by_size.setdefault(size, []).append(i)
        out: list[dict[str, torch.Tensor]] = [{} for _ in items]
        for (h, w), rows in by_size.items():
            latents = torch.stack([unpatchify_latent(items[i].inputs["latents"].to(device), h, w, patch_size)
                                   for i in rows])
            images = decode(vae, latents.to(dtype))
            for i, image in zip(rows, images):
                out[i] = {"image": to_pixels(image).cpu()}
        return out

    return StatelessEngine(run)


# --------------------------------------------------------------------------- building them


def load_generation_side(ckpt, config, device: torch.device, dtype: torch.dtype, *, dummy: bool,
                         seed: int) -> tuple[LatentProjections, ZImageVAE]:
    """The generation modules (from ``ema.safetensors``: ``load_parts``' ``generation`` part) and
    the VAE (``ae.safetensors``, the original FLUX layout, its shape read off the file; FLUX.1's
    when there is no file and ``dummy``), coverage checked both ways; with ``dummy``, seeded
    random weights (the fixed latent position table is made, never drawn), the VAE's seed one
    past the modules'. ``ckpt`` is a ``BagelCheckpoint``, ``config`` its ``BagelConfig``."""
    from mstar.model.bagel.checkpoint import VAE_FILE, load_parts
    from mstar.model.bagel.vae import config_from_shapes, flux1_vae_config, from_original_layout
    from mstar.model.weights import building, fill_weights, init_dummy_weights

    ae = ckpt.path / VAE_FILE
    vae_config = flux1_vae_config() if dummy and not ae.is_file() else config_from_shapes(_shapes(ae))
    with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
        proj = LatentProjections(config.llm.hidden_size, vae_config.net.latent_channels, config.latent_patch_size,
                                 config.max_latent_size)
        vae = ZImageVAE(vae_config)
    if dummy:
        init_dummy_weights(proj, seed=seed)  # the fixed position table is a buffer: never drawn
    else:
        load_parts({"generation": proj}, ckpt.tensors(), dtype)
    levels = len(vae_config.net.block_out_channels)
    fill_weights(vae, lambda: from_original_layout(_tensors(ae), levels),
                 dummy=dummy, seed=seed + 1, dtype=dtype)
    return proj.eval(), vae.eval()


def _tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    if not file.is_file():
        raise FileNotFoundError(f"no {file.name} in {file.parent} (BAGEL's VAE)")
    with safe_open(file, framework="pt") as handle:
        for name in handle.keys():
            yield name, handle.get_tensor(name)


def _shapes(file: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    if not file.is_file():
        raise FileNotFoundError(f"no {file.name} in {file.parent} (BAGEL's VAE)")
    with safe_open(file, framework="pt") as handle:
        return {name: handle.get_slice(name).get_shape() for name in handle.keys()}
