"""FLUX.2 [klein] text-to-image and editing: the declaration.

Three nodes: the Qwen3 text encoder (only the layers whose hidden states the DiT reads),
the DiT as a denoise engine (a Loop of flow-matching Euler steps whose loop-carried state
is the latent tokens), and the VAE (``decode``; ``encode`` for reference images). Two walks:
``t2i``, and ``edit``, which VAE-encodes up to four reference images beside the text encoder
and conditions every denoise step on their tokens (see ``mstar.model.flux2.edit``). Requests
at the same size (and, for edits, the same reference sizes) batch at every node.

Deployment knobs (``model_kwargs``): ``Flux2Knobs`` (``mstar.model.flux2.knobs``): ``max_image_area``,
``num_inference_steps`` (default 4), ``max_batch_size``, ``compile``, ``compile_backend``,
``vae_compile``, ``attention_backend``, ``cuda_graphs``, ``fused_kernels``, ``lora``, ``seed``.
The engines are built in ``mstar.model.flux2.engine``.

Nothing on a request's path waits for the GPU but the VAE node's copy of the finished pixels
to the host: position ids and schedules are made on the device once and reused, and host
inputs cross with non-blocking copies. Images leave as ``uint8`` pixels made on the device and
are encoded in the frontend in the request's ``output_format`` (``mstar.model.image_output``).
"""

from __future__ import annotations

import torch

from mstar.contract import GenerateSpec, ImageSpec, RequestError
from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.graph import Emit, Graph, Loop, Node, Parallel, Sequential, Step, Walk
from mstar.media.images import ImageError, decode_image
from mstar.model.flux2.checkpoint import Flux2Checkpoint
from mstar.model.flux2.edit import MAX_REFERENCES, pack_pixels, prepare_reference, reference_grids
from mstar.model.flux2.knobs import Flux2Knobs
from mstar.model.flux2.vae import to_tokens, token_grid
from mstar.model.image_output import ImageGenerateKnobs, ImageStream, output_params
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest


@register
class Flux2Klein(ModelSpec):
    key = "flux2_klein"
    tasks = frozenset({"image_generation", "image_edit"})
    default_weights = "black-forest-labs/FLUX.2-klein-4B"
    Knobs = Flux2Knobs
    knobs: Flux2Knobs

    def graph(self) -> Graph:
        text_encoder = Node("text_encoder", "stateless", inputs=("prompt_ids", "prompt_mask"), outputs=("text",))
        dit = Node("dit", "denoise", inputs=("latents", "text", "references"), outputs=("latents",), ops=("step",))
        vae = Node("vae", "stateless", inputs=("latents", "reference_pixels"), outputs=("image", "references"),
                   ops=("decode", "encode"))

        def encode_text() -> Step:
            return Step("text_encoder", reads=("prompt_ids", "prompt_mask"), writes="text")

        def decode() -> Step:
            return Step("vae", "decode", reads="latents", writes="image", emit=Emit("image", "image"))

        t2i = Walk("t2i", Sequential(
            encode_text(),
            Loop(Step("dit", "step", reads=("latents", "text"), writes="latents"), max_iters="num_steps",
                 progress=True),
            decode(),
        ), inputs=("prompt_ids", "prompt_mask", "latents"))
        edit = Walk("edit", Sequential(
            Parallel(encode_text(), Step("vae", "encode", reads="reference_pixels", writes="references")),
            Loop(Step("dit", "step", reads=("latents", "text", "references"), writes="latents"),
                 max_iters="num_steps", progress=True),
            decode(),
        ), inputs=("prompt_ids", "prompt_mask", "latents", "reference_pixels"))
        return Graph.build([text_encoder, dit, vae], [t2i, edit])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> Flux2Checkpoint:
        return Flux2Checkpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.text = ckpt.text()
        self.vae_config = ckpt.vae_config()

    def prepare_image(self, spec: ImageSpec, index: int = 0) -> WalkRequest:
        if not spec.prompt.strip():
            raise RequestError("prompt", "must not be empty")
        width, height = spec.width, spec.height
        multiple = 2 * self.vae_config.scale_factor
        if width % multiple or height % multiple or width < multiple or height < multiple:
            raise RequestError("size", f"width and height must be positive multiples of {multiple}")
        max_area = self.knobs.max_image_area
        if width * height > max_area:
            raise RequestError("size", f"{width}x{height} is over max_image_area ({max_area} pixels)")
        steps = self.knobs.num_inference_steps if spec.num_inference_steps is None else spec.num_inference_steps
        if not 1 <= steps <= 100:
            raise RequestError("num_inference_steps", "must be between 1 and 100")
        if spec.guidance_scale not in (None, 1.0):
            raise RequestError("guidance_scale", f"model {self.key!r} is distilled and takes no guidance")
        ids, mask = self.text.tokenize(spec.prompt)
        rows, cols = token_grid(height, width, self.vae_config.scale_factor)
        seed = (spec.seed if spec.seed is not None else torch.seed() % (1 << 31)) + index
        # drawn on a background thread while the text encoder runs; the first DiT step waits for it
        noise = FlowMatchEuler.initial_noise_soon((1, 4 * self.vae_config.latent_channels, rows, cols), seed,
                                                  finish=lambda n: to_tokens(n)[0])
        params = {"num_steps": steps, "image_seq_len": rows * cols, "rows": rows, "cols": cols,
                  **output_params(spec.model_kwargs)}
        inputs = {"prompt_ids": ids, "prompt_mask": mask, "latents": noise}
        if not spec.images:
            return WalkRequest("t2i", inputs, params)
        inputs["reference_pixels"], sizes = pack_pixels(self.references(spec.images))
        params.update(reference_sizes=sizes, reference_grids=reference_grids(sizes, self.vae_config.scale_factor))
        return WalkRequest("edit", inputs, params)

    def references(self, uploads: list[bytes]) -> list[torch.Tensor]:
        """The reference images, decoded and prepared as the pipeline conditions on them."""
        if len(uploads) > MAX_REFERENCES:
            raise RequestError("image", f"at most {MAX_REFERENCES} reference images, got {len(uploads)}")
        prepared = []
        for data in uploads:
            try:
                image = decode_image(data, field="image")
            except ImageError as err:
                raise RequestError(err.field, err.message, err.status) from None
            prepared.append(prepare_reference(image, 2 * self.vae_config.scale_factor))
        return prepared

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if set(spec.output_modalities) != {"image"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs images only")
        return self.prepare_image(ImageGenerateKnobs.parse(spec.model_kwargs).image_spec(spec))

    def output_stream(self, request: WalkRequest, stop: list[str]) -> ImageStream:
        return ImageStream.for_request(request)

    def parallel_dims(self) -> dict:
        """Every DiT node (``dit``, and ``dit_uncond`` of the guided walks) splits its heads
        over ``tp_size`` (and ``tp_size x sp_size`` with Ulysses) and its MLP width over
        ``tp_size``; the text encoder and the VAE run whole."""
        from mstar.distributed.dims import ParallelDims

        c = self.checkpoint().transformer_config()
        heads = {"num_attention_heads": c.num_attention_heads}
        dims = ParallelDims(tensor={**heads, "mlp_hidden_dim": int(c.inner_dim * c.mlp_ratio)}, sequence=heads)
        return {name: dims for name, node in self.graph().nodes.items() if node.kind == "denoise"}

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.flux2.engine import flux2_engines

        return flux2_engines(self.checkpoint(), self.knobs, self.config, nodes, device)


@register
class Flux2Klein9B(Flux2Klein):
    """FLUX.2 [klein] 9B: the same model class at another size (Qwen3-8B encoder, 4096-wide DiT)."""

    key = "flux2_klein_9b"
    default_weights = "black-forest-labs/FLUX.2-klein-9B"
