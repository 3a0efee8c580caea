"""Z-Image-Turbo text-to-image: the declaration.

Three nodes, as for FLUX.2 [klein]: the Qwen3 caption encoder (layers up to the penultimate
one), the single-stream DiT as a denoise engine (a Loop of flow-match Euler steps; the
loop-carried state is the VAE-shaped latents ``[16, H/8, W/8]``), and the FLUX.1 VAE decoder.
Requests at the same size batch at every node, whatever their prompt lengths.

The Turbo checkpoint is distilled: 8 steps by default, no classifier-free guidance, static
shift 3 (its ``scheduler/scheduler_config.json``). Deployment knobs (``model_kwargs``):
``max_image_area`` (pixels, default 2048x2048), ``num_inference_steps`` (default 8),
``max_batch_size`` (DiT rows per forward), ``compile`` (torch.compile each DiT block, with
``compile_backend``, default inductor; eager is the reference), ``lora`` (adapters folded into
the DiT at load, ``mstar.model.z_image.lora_layout``), ``seed`` (of dummy weights).

``compile`` compiles the transformer blocks, not the whole DiT: the blocks see padded
``[rows, tokens, dim]`` batches whose token counts are multiples of 32, so a few traces cover
every request, while the ragged per-request work around them (patches, caption padding, rotary
tables) stays eager.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from mstar.contract import GenerateSpec, ImageSpec, RequestError
from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.engine.base import StatelessEngine
from mstar.engine.denoise import DenoiseEngine
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.diffusion_knobs import (
    MAX_STEPS,
    DiffusionKnobs,
    load_component,
    text_encoder_engine,
)
from mstar.model.image_output import ImageStream, output_params
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.z_image.config import ZImageTransformerConfig
from mstar.model.z_image.lora_layout import fold_z_image_adapters
from mstar.model.z_image.schedule import TURBO_SCHEDULER, ZImageSchedule
from mstar.model.z_image.text import ZImageText
from mstar.model.z_image.transformer import ZImageTransformer
from mstar.model.z_image.vae import ZImageVAE, ZImageVAEConfig

DEFAULT_STEPS = 8  # the distilled Turbo checkpoint (diffusers' example and the model card)


class Knobs(DiffusionKnobs):
    """Z-Image's deployment knobs (mstar/model/diffusion_knobs.py), 8 steps by default."""

    def __init__(self, kwargs: dict):
        super().__init__(kwargs, DEFAULT_STEPS)


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@register
class ZImageTurbo(ModelSpec):
    key = "z_image_turbo"
    tasks = frozenset({"image_generation"})  # no edit walk: text to image only
    default_weights = "Tongyi-MAI/Z-Image-Turbo"

    def graph(self) -> Graph:
        text_encoder = Node("text_encoder", "stateless", inputs=("prompt_ids", "prompt_mask"), outputs=("text",))
        dit = Node("dit", "denoise", inputs=("latents", "text"), outputs=("latents",), ops=("step",))
        vae = Node("vae", "stateless", inputs=("latents",), outputs=("image",), ops=("decode",))
        t2i = Walk("t2i", Sequential(
            Step("text_encoder", reads=("prompt_ids", "prompt_mask"), writes="text"),
            Loop(Step("dit", "step", reads=("latents", "text"), writes="latents"), max_iters="num_steps"),
            Step("vae", "decode", reads="latents", writes="image", emit=Emit("image", "image")),
        ), inputs=("prompt_ids", "prompt_mask", "latents"))
        return Graph.build([text_encoder, dit, vae], [t2i])

    # -------------------------------------------------------------- frontend
    def directory(self) -> Path:
        from mstar.model.weights import resolve_model_path

        return resolve_model_path(self.config.model_path or self.default_weights, cache_dir=self.config.cache_dir)

    def load_frontend(self) -> None:
        root = self.directory()
        self.text = ZImageText.from_directory(root)
        self.vae_config = ZImageVAEConfig.from_dict(_json(root / "vae" / "config.json"))
        self.latent_channels = int(_json(root / "transformer" / "config.json").get("in_channels", 16))
        self.knobs = Knobs(self.config.model_kwargs)

    def prepare_image(self, spec: ImageSpec, index: int = 0) -> WalkRequest:
        if not spec.prompt.strip():
            raise RequestError("prompt", "must not be empty")
        if spec.images:
            raise RequestError("image", f"model {self.key!r} generates from text only; it does not edit images")
        width, height = spec.width, spec.height
        multiple = 2 * self.vae_config.scale_factor
        if width % multiple or height % multiple or width < multiple or height < multiple:
            raise RequestError("size", f"width and height must be positive multiples of {multiple}")
        if width * height > self.knobs.max_area:
            raise RequestError("size", f"{width}x{height} is over max_image_area ({self.knobs.max_area} pixels)")
        steps = self.knobs.default_steps if spec.num_inference_steps is None else spec.num_inference_steps
        if not 1 <= steps <= MAX_STEPS:
            raise RequestError("num_inference_steps", f"must be between 1 and {MAX_STEPS}")
        if spec.guidance_scale not in (None, 0.0, 1.0):
            raise RequestError("guidance_scale", f"model {self.key!r} is distilled and takes no guidance "
                                                 "(leave it unset, 0 or 1)")
        ids, mask = self.text.tokenize(spec.prompt)
        scale = self.vae_config.scale_factor
        seed = (spec.seed if spec.seed is not None else torch.seed() % (1 << 31)) + index
        noise = FlowMatchEuler.initial_noise_soon((1, self.latent_channels, height // scale, width // scale), seed,
                                                  finish=lambda n: n[0])  # drawn while the text encoder runs
        params = {"num_steps": steps, "image_seq_len": (height // multiple) * (width // multiple),
                  "caption_len": int(mask.sum()), **output_params(spec.model_kwargs)}
        return WalkRequest("t2i", {"prompt_ids": ids, "prompt_mask": mask, "latents": noise}, params)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if set(spec.output_modalities) != {"image"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs images only")
        kw = spec.model_kwargs
        return self.prepare_image(ImageSpec(spec.request_id, spec.text, int(kw.get("width", 1024)),
                                            int(kw.get("height", 1024)), 1, kw.get("seed"),
                                            kw.get("num_inference_steps"), kw.get("guidance_scale"),
                                            [data for _, data in spec.files]))

    def output_stream(self, request: WalkRequest, stop: list[str]) -> ImageStream:
        return ImageStream.for_request(request)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        root = self.directory()
        dtype = self.config.torch_dtype()
        knobs = Knobs(self.config.model_kwargs)

        def build(module: torch.nn.Module, folder: str, offset: int, **load) -> torch.nn.Module:
            return load_component(module, root / folder, device=device, dtype=dtype,
                                  dummy=self.config.load_format == "dummy", seed=knobs.seed + offset, **load)

        engines = {}
        if "text_encoder" in nodes:
            engines["text_encoder"] = text_encoder_engine(ZImageText.from_directory(root), build)
        if "dit" in nodes:
            dit_config = ZImageTransformerConfig.from_dict(_json(root / "transformer" / "config.json"))
            dit = build(ZImageTransformer(dit_config), "transformer", 2)
            fold_z_image_adapters(dit, knobs.lora)  # in fp32, one rounding per weight
            if knobs.compile:
                for block in (*dit.noise_refiner, *dit.context_refiner, *dit.layers):
                    block.compile(backend=knobs.compile_backend)
            scheduler_file = root / "scheduler" / "scheduler_config.json"
            schedule = ZImageSchedule.from_config(_json(scheduler_file) if scheduler_file.exists() else TURBO_SCHEDULER)

            def velocity(latents, text, t, params):
                # The engine keeps latents, captions and time in float32 (as the pipeline does);
                # the DiT runs in the deployment dtype and predicts the negated velocity.
                captions = [row[: p["caption_len"]].to(dtype) for row, p in zip(text, params)]
                with knobs.attention_scope():
                    return -dit(latents.to(dtype), t, captions)

            engines["dit"] = DenoiseEngine(velocity, schedule, device, torch.float32, **knobs.batching)
        if "vae" in nodes:
            vae = build(ZImageVAE(ZImageVAEConfig.from_dict(_json(root / "vae" / "config.json"))), "vae", 3)
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

            engines["vae"] = StatelessEngine(decode)
        return engines
