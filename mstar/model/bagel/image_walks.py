"""BAGEL's generation side in the declaration: its nodes, the ``generate`` and ``edit`` walks,
how an image request becomes one, and its engines. ``Bagel`` (``model.py``) mixes it in.

Nodes: ``generator`` (the MoT LLM's generation side over a KV pool of its own:
``mstar.model.bagel.image_engine``) and ``vae`` (the decoder). Walks:

- ``generate``: the generator builds the request's contexts (op ``context``), a Loop of
  ``num_steps`` Euler steps (op ``step``; every request's guidance variants in one forward),
  the VAE decodes the latent tokens to the emitted image;
- ``edit``: the same, the input image first through the ``vision`` node (its ViT tokens join
  the contexts with its VAE latents, which the generator encodes).
"""

from __future__ import annotations

import torch

from mstar.contract import ImageSpec, RequestError
from mstar.graph import Emit, Loop, Node, Sequential, Step, Walk
from mstar.model.bagel.image_request import EDIT, GENERATE, LatentShape, image_request, vae_pixels
from mstar.model.image_output import ImageStream
from mstar.model.spec import WalkRequest

GENERATOR, VAE = "generator", "vae"
VISION_INPUTS = ("patches", "patch_positions", "patch_counts")  # the vision node's (model.py)


class BagelImageWalks:
    """The generation side of ``Bagel``: it reads ``self.tokenizer``, ``self.bagel_config``,
    ``self.knobs`` (``vit_resize``, ``vae_resize``, ``max_image_pixels``, ``generator_kv_pages``)
    and ``self.config`` as the understanding side sets them."""

    image_tasks = frozenset({"image_generation", "image_edit"})

    def image_nodes(self) -> list[Node]:
        return [Node(GENERATOR, "denoise", inputs=("prompt_ids", "latents", "image", "image_noise", "vision_embeds"),
                     outputs=("latents",), ops=("context", "step")),
                Node(VAE, "stateless", inputs=("latents",), outputs=("image",), ops=("decode",))]

    def image_walks(self, vision: str) -> list[Walk]:
        def steps(context_reads: tuple[str, ...]) -> list:
            return [Step(GENERATOR, "context", reads=context_reads, writes="latents"),
                    Loop(Step(GENERATOR, "step", reads="latents", writes="latents"), max_iters="num_steps",
                         progress=True),
                    Step(VAE, "decode", reads="latents", writes="image", emit=Emit("image", "image"))]

        generate = Walk(GENERATE, Sequential(*steps(("prompt_ids", "latents"))), inputs=("prompt_ids", "latents"))
        edit_reads = ("prompt_ids", "latents", "image", "image_noise", "vision_embeds")
        edit = Walk(EDIT, Sequential(Step(vision, reads=VISION_INPUTS, writes="vision_embeds"), *steps(edit_reads)),
                    inputs=("prompt_ids", "latents", "image", "image_noise", *VISION_INPUTS))
        return [generate, edit]

    # ------------------------------------------------------------ frontend
    def latent_shape(self) -> LatentShape:
        from mstar.model.bagel.checkpoint import VAE_FILE
        from mstar.model.bagel.image_engine import _shapes
        from mstar.model.bagel.vae import config_from_shapes

        cfg = self.bagel_config
        ae = self.checkpoint().path / VAE_FILE
        vae = config_from_shapes(_shapes(ae)) if ae.is_file() else None
        channels = vae.net.latent_channels if vae is not None else 16
        scale = vae.scale_factor if vae is not None else 8
        return LatentShape(channels, cfg.latent_patch_size, scale * cfg.latent_patch_size, cfg.max_latent_size)

    def prepare_image(self, spec: ImageSpec, index: int = 0) -> WalkRequest:
        if not hasattr(self, "_latent_shape"):
            self._latent_shape = self.latent_shape()
        ids = self.tokenizer.encode(spec.prompt, add_special_tokens=False) if spec.prompt.strip() else []
        if not spec.images:
            return image_request(spec, ids, self._latent_shape, index=index)
        if len(spec.images) > 1:
            raise RequestError("image", f"BAGEL edits one image, got {len(spec.images)}")
        from mstar.media.images import ImageError, decode_image
        from mstar.model.bagel.vision import preprocess

        try:
            image = decode_image(spec.images[0], max_pixels=self.knobs.max_image_pixels, field="image")
        except ImageError as err:
            raise RequestError(err.field, err.message, err.status) from None
        vit = self.bagel_config.vision.patch_size
        vae_resize, vit_resize = tuple(self.knobs.vae_resize), tuple(self.knobs.vit_resize)
        return image_request(spec, ids, self._latent_shape, index=index, edit_image=vae_pixels(image, vae_resize),
                             vit_image=preprocess(image, vit, vit_resize, vae_resize), vit_patch=vit,
                             vit_max_side=self.bagel_config.vit_max_num_patch_per_side)

    def output_stream(self, request: WalkRequest, stop: list[str]):
        if request.walk in (GENERATE, EDIT):
            return ImageStream.for_request(request)
        return super().output_stream(request, stop)  # type: ignore[misc]

    # ------------------------------------------------------------ worker
    def image_engines(self, nodes: set[str], device: torch.device, model) -> dict:
        """The generator (on ``model``, the language model loaded on this rank) and the VAE,
        for those of them placed here."""
        from mstar.model.bagel.image_engine import BagelImageEngine, load_generation_side, vae_decode_engine

        if not {GENERATOR, VAE} & nodes:
            return {}
        ckpt, dtype = self.checkpoint(), self.config.torch_dtype()
        proj, vae = load_generation_side(ckpt, ckpt.config(), device, dtype, dummy=self.config.load_format == "dummy",
                                         seed=self.knobs.seed + 2)
        engines = {}
        if GENERATOR in nodes:
            tokens = ckpt.special_tokens(ckpt.tokenizer())
            engines[GENERATOR] = BagelImageEngine(
                model, proj, vae, tokens, num_pages=self.knobs.generator_kv_pages,
                page_size=self.config.resources.kv_cache.page_size, device=device, dtype=dtype,
                attention_backend=self.knobs.attention_backend)
        if VAE in nodes:
            engines[VAE] = vae_decode_engine(vae, device, dtype, proj.patch_size)
        return engines
