"""FLUX.2 [klein] text-to-image and editing: the declaration.

Three nodes: the Qwen3 text encoder (only the layers whose hidden states the DiT reads),
the DiT as a denoise engine (a Loop of flow-matching Euler steps whose loop-carried state
is the latent tokens), and the VAE (``decode``; ``encode`` for reference images). Two walks:
``t2i``, and ``edit``, which VAE-encodes up to four reference images beside the text encoder
and conditions every denoise step on their tokens (see ``mstar.model.flux2.edit``). Requests
at the same size (and, for edits, the same reference sizes) batch at every node.

Deployment knobs (``model_kwargs``): ``max_image_area`` (pixels, default 2048x2048),
``num_inference_steps`` (default 4), ``max_batch_size`` (DiT rows per forward), ``compile``
(torch.compile the DiT, with ``compile_backend``, default inductor; eager is the reference),
``vae_compile``, ``attention_backend`` (``sdpa`` or ``cudnn``, see ``mstar.model.diffusion_knobs``),
``cuda_graphs`` (the text encoder replayed from a CUDA graph per prompt shape), ``lora``
(adapters folded into the DiT at load, ``mstar.model.lora``).

Nothing on a request's path waits for the GPU but the VAE node's copy of the finished pixels
to the host: position ids and schedules are made on the device once and reused, and host
inputs cross with non-blocking copies. Images leave as ``uint8`` pixels made on the device and
are encoded in the frontend in the request's ``output_format`` (``mstar.model.image_output``).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from mstar.contract import GenerateSpec, ImageSpec, RequestError
from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.engine.base import StatelessEngine
from mstar.graph import Emit, Graph, Loop, Node, Parallel, Sequential, Step, Walk
from mstar.media.images import ImageError, decode_image
from mstar.model.diffusion_knobs import (
    DiffusionKnobs,
    load_component,
    text_encoder_engine,
)
from mstar.model.flux2.config import Flux2TransformerConfig
from mstar.model.flux2.edit import (
    MAX_REFERENCES,
    ReferenceDenoiseEngine,
    encode_references,
    pack_pixels,
    prepare_reference,
    reference_grids,
    reference_ids,
)
from mstar.model.flux2.lora_layout import flux2_lora_targets
from mstar.model.flux2.text import KleinText
from mstar.model.flux2.transformer import Flux2Transformer, use_fused_qk_norm_rope
from mstar.model.flux2.vae import (
    Flux2VAE,
    Flux2VAEConfig,
    to_tokens,
    token_grid,
    unpack_latents,
)
from mstar.model.image_output import ImageStream, output_params, to_pixels
from mstar.model.lora import fold_adapters
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest

log = logging.getLogger(__name__)

DEFAULT_STEPS = 4  # the distilled klein checkpoints


def text_ids(length: int) -> torch.Tensor:
    """Positions of text tokens on FLUX.2's four rotary axes (t, h, w, l): l counts tokens."""
    ids = torch.zeros(length, 4, dtype=torch.int64)
    ids[:, 3] = torch.arange(length)
    return ids


def image_ids(rows: int, cols: int) -> torch.Tensor:
    """Positions of latent tokens (t, h, w, l): h and w index the token grid row-major."""
    ids = torch.zeros(rows * cols, 4, dtype=torch.int64)
    ids[:, 1] = torch.arange(rows).repeat_interleave(cols)
    ids[:, 2] = torch.arange(cols).repeat(rows)
    return ids


def token_ids(params: dict) -> torch.Tensor:
    """Positions of a request's DiT tokens: its image grid, then its references (if any)."""
    ids = image_ids(params["rows"], params["cols"])
    grids = params.get("reference_grids")
    return torch.cat([ids, reference_ids(grids)]) if grids else ids


def token_layout(params: dict) -> tuple:
    """What a request's ``token_ids`` depend on (a cache key)."""
    return params["rows"], params["cols"], tuple(tuple(g) for g in params.get("reference_grids") or ())


class DeviceIds:
    """The DiT's position ids on the device, made once per layout of a batch's rows and text
    length (``ids_cache`` layouts kept): a fresh host-to-device copy every step would make
    the host wait for the GPU's previous step before it could launch this one."""

    def __init__(self, device: torch.device, ids_cache: int = 64):
        self.device = device
        self._make = functools.lru_cache(maxsize=ids_cache)(self._build)

    def _build(self, layouts: tuple, text_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [{"rows": r, "cols": c, "reference_grids": [list(g) for g in grids]} for r, c, grids in layouts]
        image = torch.stack([token_ids(p) for p in rows]).to(self.device, non_blocking=True)
        return image, text_ids(text_length).to(self.device, non_blocking=True)

    def __call__(self, params: list[dict], text_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._make(tuple(token_layout(p) for p in params), text_length)


class Knobs(DiffusionKnobs):
    """klein's deployment knobs (mstar/model/diffusion_knobs.py), 4 steps by default."""

    def __init__(self, kwargs: dict):
        super().__init__(kwargs, DEFAULT_STEPS)


PngStream = ImageStream  # its former name (a default ImageStream encodes PNG)


@register
class Flux2Klein(ModelSpec):
    key = "flux2_klein"
    tasks = frozenset({"image_generation", "image_edit"})
    default_weights = "black-forest-labs/FLUX.2-klein-4B"

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
            Loop(Step("dit", "step", reads=("latents", "text"), writes="latents"), max_iters="num_steps"),
            decode(),
        ), inputs=("prompt_ids", "prompt_mask", "latents"))
        edit = Walk("edit", Sequential(
            Parallel(encode_text(), Step("vae", "encode", reads="reference_pixels", writes="references")),
            Loop(Step("dit", "step", reads=("latents", "text", "references"), writes="latents"),
                 max_iters="num_steps"),
            decode(),
        ), inputs=("prompt_ids", "prompt_mask", "latents", "reference_pixels"))
        return Graph.build([text_encoder, dit, vae], [t2i, edit])

    # -------------------------------------------------------------- frontend
    def directory(self) -> Path:
        from mstar.model.weights import resolve_model_path

        return resolve_model_path(self.config.model_path or self.default_weights, cache_dir=self.config.cache_dir)

    def load_frontend(self) -> None:
        root = self.directory()
        self.text = KleinText.from_directory(root)
        self.vae_config = Flux2VAEConfig.from_dict(json.loads((root / "vae" / "config.json").read_text()))
        knobs = Knobs(self.config.model_kwargs)
        self.max_area, self.default_steps = knobs.max_area, knobs.default_steps

    def prepare_image(self, spec: ImageSpec, index: int = 0) -> WalkRequest:
        if not spec.prompt.strip():
            raise RequestError("prompt", "must not be empty")
        width, height = spec.width, spec.height
        multiple = 2 * self.vae_config.scale_factor
        if width % multiple or height % multiple or width < multiple or height < multiple:
            raise RequestError("size", f"width and height must be positive multiples of {multiple}")
        if width * height > self.max_area:
            raise RequestError("size", f"{width}x{height} is over max_image_area ({self.max_area} pixels)")
        steps = self.default_steps if spec.num_inference_steps is None else spec.num_inference_steps
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
        kw = spec.model_kwargs
        return self.prepare_image(ImageSpec(spec.request_id, spec.text, int(kw.get("width", 1024)),
                                            int(kw.get("height", 1024)), 1, kw.get("seed"),
                                            kw.get("num_inference_steps"), kw.get("guidance_scale"),
                                            [data for _, data in spec.files], kw))

    def output_stream(self, request: WalkRequest, stop: list[str]) -> ImageStream:
        return ImageStream.for_request(request)

    def parallel_dims(self) -> dict:
        """Every DiT node (``dit``, and ``dit_uncond`` of the guided walks) splits its heads
        over ``tp_size`` (and ``tp_size x sp_size`` with Ulysses) and its MLP width over
        ``tp_size``; the text encoder and the VAE run whole."""
        from mstar.distributed.dims import ParallelDims

        config_file = self.directory() / "transformer" / "config.json"
        c = Flux2TransformerConfig.from_dict(json.loads(config_file.read_text()))
        heads = {"num_attention_heads": c.num_attention_heads}
        dims = ParallelDims(tensor={**heads, "mlp_hidden_dim": int(c.inner_dim * c.mlp_ratio)}, sequence=heads)
        return {name: dims for name, node in self.graph().nodes.items() if node.kind == "denoise"}

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
            engines["text_encoder"] = text_encoder_engine(KleinText.from_directory(root), build, knobs.cuda_graphs)
        if "dit" in nodes:
            config = Flux2TransformerConfig.from_dict(json.loads((root / "transformer" / "config.json").read_text()))
            dit = build(Flux2Transformer(config), "transformer", 2)
            fold_adapters(dit, knobs.lora, targets=flux2_lora_targets)  # in fp32, one rounding per weight
            if knobs.fused_kernels:
                if device.type != "cuda":
                    raise ValueError("model_kwargs.fused_kernels needs device: cuda")
                use_fused_qk_norm_rope(dit)
            forward = torch.compile(dit, backend=knobs.compile_backend) if knobs.compile else dit
            device_ids = DeviceIds(device)

            def velocity(latents, text, t, params):
                ids, txt_ids = device_ids(params, text.shape[1])
                with knobs.attention_scope():
                    return forward(latents, text, t, ids, txt_ids, guidance=None)

            engines["dit"] = ReferenceDenoiseEngine(velocity, FlowMatchEuler(), device, dtype, **knobs.batching)
        if "vae" in nodes:
            vae = build(Flux2VAE(Flux2VAEConfig.from_dict(json.loads((root / "vae" / "config.json").read_text()))),
                        "vae", 3)
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

            engines["vae"] = StatelessEngine(run)
        return engines


@register
class Flux2Klein9B(Flux2Klein):
    """FLUX.2 [klein] 9B: the same model class at another size (Qwen3-8B encoder, 4096-wide DiT)."""

    key = "flux2_klein_9b"
    default_weights = "black-forest-labs/FLUX.2-klein-9B"
