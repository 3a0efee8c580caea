"""FLUX.2 [klein] text-to-image: the declaration.

Three nodes: the Qwen3 text encoder (only the layers whose hidden states the DiT reads),
the DiT as a denoise engine (a Loop of flow-matching Euler steps whose loop-carried state
is the latent tokens), and the VAE decoder. Requests at the same size batch at every node.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import torch

from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.engine.base import StatelessEngine
from mstar.engine.denoise import DenoiseEngine
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.flux2.config import Flux2TransformerConfig
from mstar.model.flux2.text import KleinText
from mstar.model.flux2.transformer import Flux2Transformer
from mstar.model.flux2.vae import Flux2VAE, Flux2VAEConfig, token_grid, to_tokens, unpack_latents
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest
from mstar.server.backend import GenerateSpec, ImageSpec, OutputEvent, RequestError

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


class PngStream(OutputStream):
    """An emitted image tensor in [-1, 1], [3, H, W] -> one PNG event."""

    def __init__(self):
        self.images = 0

    @property
    def generated(self) -> int:
        return self.images

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        from PIL import Image

        pixels = ((value.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        buffer = io.BytesIO()
        Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
        self.images += 1
        return OutputEvent(modality="image", data=buffer.getvalue())


@register
class Flux2Klein(ModelSpec):
    key = "flux2_klein"
    default_weights = "black-forest-labs/FLUX.2-klein-4B"

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
        self.text = KleinText.from_directory(root)
        self.vae_config = Flux2VAEConfig.from_dict(json.loads((root / "vae" / "config.json").read_text()))
        kwargs = self.config.model_kwargs
        self.max_area = int(kwargs.get("max_image_area", 2048 * 2048))
        self.default_steps = int(kwargs.get("num_inference_steps", DEFAULT_STEPS))

    def prepare_image(self, spec: ImageSpec, index: int = 0) -> WalkRequest:
        if not spec.prompt.strip():
            raise RequestError("prompt", "must not be empty")
        if spec.images:
            raise RequestError("image", f"model {self.key!r} does not edit images yet")
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
        noise = FlowMatchEuler.initial_noise((1, 4 * self.vae_config.latent_channels, rows, cols), seed)
        params = {"num_steps": steps, "image_seq_len": rows * cols, "rows": rows, "cols": cols}
        return WalkRequest("t2i", {"prompt_ids": ids, "prompt_mask": mask, "latents": to_tokens(noise)[0]}, params)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if set(spec.output_modalities) != {"image"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs images only")
        kw = spec.model_kwargs
        return self.prepare_image(ImageSpec(spec.request_id, spec.text, int(kw.get("width", 1024)),
                                            int(kw.get("height", 1024)), 1, kw.get("seed"),
                                            kw.get("num_inference_steps"), kw.get("guidance_scale")))

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PngStream:
        return PngStream()

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.weights import init_dummy_weights, iter_safetensors, load_weights

        root = self.directory()
        dtype = self.config.torch_dtype()
        dummy = self.config.load_format == "dummy"
        seed = int(self.config.model_kwargs.get("seed", 0))

        def build(module: torch.nn.Module, folder: str, offset: int, **load) -> torch.nn.Module:
            module = module.to(device=device, dtype=dtype)
            if dummy:
                init_dummy_weights(module, seed=seed + offset)
            else:
                load_weights(module, iter_safetensors(root / folder), dtype=dtype, **load)
            return module.eval()

        engines = {}
        if "text_encoder" in nodes:
            text = KleinText.from_directory(root)
            encoder = text.build_encoder()
            encoder = build(encoder, "text_encoder", 1, name_map=encoder.checkpoint_name_map)
            engines["text_encoder"] = StatelessEngine(lambda op, items: [
                {"text": e} for e in text.encode(encoder, [i.inputs["prompt_ids"] for i in items],
                                                 [i.inputs["prompt_mask"] for i in items])])
        if "dit" in nodes:
            config = Flux2TransformerConfig.from_dict(json.loads((root / "transformer" / "config.json").read_text()))
            dit = build(Flux2Transformer(config), "transformer", 2)

            def velocity(latents, text, t, params):
                img = image_ids(params[0]["rows"], params[0]["cols"]).to(device)
                return dit(latents, text, t, img, text_ids(text.shape[1]).to(device), guidance=None)

            engines["dit"] = DenoiseEngine(velocity, FlowMatchEuler(), device, dtype)
        if "vae" in nodes:
            vae = build(Flux2VAE(Flux2VAEConfig.from_dict(json.loads((root / "vae" / "config.json").read_text()))),
                        "vae", 3)

            def decode(op, items):
                out = []
                for item in items:  # sizes differ between requests; decode each
                    p = item.params
                    latents = unpack_latents(item.inputs["latents"][None].to(device, dtype), p["rows"], p["cols"],
                                             *vae.latent_norm())
                    out.append({"image": vae.decode(latents)[0].float().cpu()})
                return out

            engines["vae"] = StatelessEngine(decode)
        return engines
