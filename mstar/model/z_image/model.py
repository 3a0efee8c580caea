"""Z-Image-Turbo text-to-image: the declaration.

Three nodes, as for FLUX.2 [klein]: the Qwen3 caption encoder (layers up to the penultimate
one), the single-stream DiT as a denoise engine (a Loop of flow-match Euler steps; the
loop-carried state is the VAE-shaped latents ``[16, H/8, W/8]``), and the FLUX.1 VAE decoder.
Requests at the same size batch at every node, whatever their prompt lengths.

The Turbo checkpoint is distilled: 8 steps by default, no classifier-free guidance, static
shift 3 (its ``scheduler/scheduler_config.json``). Deployment knobs (``model_kwargs``):
``ZImageKnobs`` (``mstar.model.z_image.knobs``): ``max_image_area``, ``num_inference_steps``
(default 8), ``max_batch_size``, ``compile`` (each DiT block), ``compile_backend``,
``vae_compile``, ``attention_backend``, ``lora``, ``seed``. The engines are built in
``mstar.model.z_image.engine``.
"""

from __future__ import annotations

import torch

from mstar.contract import GenerateSpec, ImageSpec, RequestError
from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.diffusion_knobs import MAX_STEPS
from mstar.model.image_output import ImageGenerateKnobs, ImageStream, output_params
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.z_image.checkpoint import ZImageCheckpoint
from mstar.model.z_image.knobs import ZImageKnobs


@register
class ZImageTurbo(ModelSpec):
    key = "z_image_turbo"
    tasks = frozenset({"image_generation"})  # no edit walk: text to image only
    default_weights = "Tongyi-MAI/Z-Image-Turbo"
    Knobs = ZImageKnobs
    knobs: ZImageKnobs

    def graph(self) -> Graph:
        text_encoder = Node("text_encoder", "stateless", inputs=("prompt_ids", "prompt_mask"), outputs=("text",))
        dit = Node("dit", "denoise", inputs=("latents", "text"), outputs=("latents",), ops=("step",))
        vae = Node("vae", "stateless", inputs=("latents",), outputs=("image",), ops=("decode",))
        t2i = Walk("t2i", Sequential(
            Step("text_encoder", reads=("prompt_ids", "prompt_mask"), writes="text"),
            Loop(Step("dit", "step", reads=("latents", "text"), writes="latents"), max_iters="num_steps",
                 progress=True),
            Step("vae", "decode", reads="latents", writes="image", emit=Emit("image", "image")),
        ), inputs=("prompt_ids", "prompt_mask", "latents"))
        return Graph.build([text_encoder, dit, vae], [t2i])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> ZImageCheckpoint:
        return ZImageCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.text = ckpt.text()
        self.vae_config = ckpt.vae_config()
        self.latent_channels = ckpt.latent_channels()

    def prepare_image(self, spec: ImageSpec, index: int = 0) -> WalkRequest:
        if not spec.prompt.strip():
            raise RequestError("prompt", "must not be empty")
        if spec.images:
            raise RequestError("image", f"model {self.key!r} generates from text only; it does not edit images")
        width, height = spec.width, spec.height
        multiple = 2 * self.vae_config.scale_factor
        if width % multiple or height % multiple or width < multiple or height < multiple:
            raise RequestError("size", f"width and height must be positive multiples of {multiple}")
        max_area = self.knobs.max_image_area
        if width * height > max_area:
            raise RequestError("size", f"{width}x{height} is over max_image_area ({max_area} pixels)")
        steps = self.knobs.num_inference_steps if spec.num_inference_steps is None else spec.num_inference_steps
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
        return self.prepare_image(ImageGenerateKnobs.parse(spec.model_kwargs).image_spec(spec))

    def output_stream(self, request: WalkRequest, stop: list[str]) -> ImageStream:
        return ImageStream.for_request(request)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.z_image.engine import z_image_engines

        return z_image_engines(self.checkpoint(), self.knobs, self.config, nodes, device)
