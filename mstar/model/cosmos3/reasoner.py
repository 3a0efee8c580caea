"""The Cosmos3-Edge reasoner: image and video chat on the tower's understanding expert.

The reasoner is a vision-language model whose language model *is* the generator's tower read
as a causal LM: the understanding expert (``to_q`` ... ``to_out``, ``mlp``, the understanding
norms), ``embed_tokens``, the final ``norm`` and ``lm_head``. ``Cosmos3Reasoner`` holds the
tower it is given and reads those modules; it owns no copy of them (one set of weights in the
process for both the denoise engine and the chat engine). The maths is transformers'
``Cosmos3EdgeForConditionalGeneration`` (5.25): a dense Nemotron decoder (no q/k norms on Edge,
squared-ReLU MLPs) with three-axis rotary positions (the tower's interleaved frequencies), over
paged KV (``mstar.layers.attention.paged_attention``) so it runs on the autoregressive engine.

Vision (``Cosmos3Vision``): a packed SigLIP2 tower (``visual``: a linear patch embedding of
``3 x 16 x 16`` patches plus a learned ``16 x 16`` position table resized per image with
antialiased bilinear interpolation, pre-norm blocks attending within one image or video frame,
a final LayerNorm) and the projector (``projector``: LayerNorm over each patch, the 2 x 2 merge
group's four patches concatenated, Linear, exact GELU, Linear), one row per merged group.
Patches come block-major (each 2 x 2 merge group's four patches together), as the reference's
image processor lays them out (``image_patches``). A video is a list of frames each of which is
an image of its own to the tower (``grid_thw`` with t = 1 per frame).

Prompt layout: an image is ``<|vision_start|>`` + one ``image_token_id`` per merged group +
``<|vision_end|>``; a video frame is ``<T.T seconds>`` text, then the same with
``video_token_id``. ``rope_positions`` gives the reference's ``get_rope_index``: text tokens at
``p, p, p``; a media run at time ``p`` with rows and columns ``p + i``, after which ``p``
advances by the longer side of the merged grid. Decodes run at ``cache index + delta``.

Weights: the tower's from ``transformer/`` (already loaded by the generator); ``visual.*`` and
``projector.*`` (transformers' native names) with their config (transformers'
``Cosmos3EdgeConfig``: ``vision_config``, ``projector_hidden_size``, the token ids) from the
checkpoint's ``reasoner/`` folder (``Cosmos3Vision.load``, coverage both ways).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engine.base import EngineItem
from mstar.engine.forward import Forward
from mstar.layers.attention import paged_attention
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.layers.rotary import rotate
from mstar.model.cosmos3.transformer import Cosmos3Transformer
from mstar.model.siglip import SiglipEncoder

__all__ = ["Cosmos3Reasoner", "Cosmos3Vision", "ReasonerConfig", "ReasonerForward", "image_patches",
           "rope_positions", "sample_frames", "smart_resize", "video_patches"]

IMAGE_MEAN = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN / STD of the reference's image processor
IMAGE_STD = (0.5, 0.5, 0.5)


@dataclass
class ReasonerConfig:
    """The vision tower, projector and prompt ids (transformers' ``Cosmos3EdgeConfig`` names)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    num_patches: int = 256
    spatial_merge_size: int = 2
    projector_hidden_size: int = 11520
    text_hidden_size: int = 2048
    image_token_id: int = 19
    video_token_id: int = 18
    vision_start_token_id: int = 20
    vision_end_token_id: int = 21
    min_pixels: int = 256 * 256  # the image processor's size.shortest_edge (an area)
    max_pixels: int = 4096 * 4096  # size.longest_edge

    @classmethod
    def from_dict(cls, config: dict[str, Any], text_hidden_size: int | None = None) -> ReasonerConfig:
        vision = dict(config.get("vision_config") or {})
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported (Cosmos3-Edge uses gelu_pytorch_tanh)")
        fields = {k: vision[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_channels", "patch_size", "layer_norm_eps",
                                         "num_patches", "spatial_merge_size") if k in vision}
        fields.update({k: config[k] for k in ("projector_hidden_size", "image_token_id", "video_token_id",
                                              "vision_start_token_id", "vision_end_token_id") if k in config})
        text = (config.get("text_config") or {}).get("hidden_size")
        out = cls(**fields, text_hidden_size=int(text_hidden_size or text or cls.text_hidden_size))
        if isinstance(out.patch_size, (list, tuple)):
            out.patch_size = int(out.patch_size[0])
        if math.isqrt(out.num_patches) ** 2 != out.num_patches:
            raise ValueError(f"vision_config.num_patches {out.num_patches} is not a square")
        return out


# ----------------------------------------------------------------------- vision
class VisionEmbeddings(nn.Module):
    def __init__(self, config: ReasonerConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embedding = nn.Linear(config.num_channels * config.patch_size ** 2, config.hidden_size)
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)

    def positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The position table resized to each grid (float32 maths), in the patches' block-major
        order, repeated over the grid's frames."""
        side, m = math.isqrt(self.config.num_patches), self.config.spatial_merge_size
        table = self.position_embedding.weight.reshape(side, side, -1).permute(2, 0, 1)[None].float()
        out = []
        for t, h, w in grids:
            resized = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
            resized = resized[0].permute(1, 2, 0).to(self.position_embedding.weight.dtype)
            blocks = resized.reshape(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)
            out.append(blocks.repeat(t, 1))
        return torch.cat(out)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))
        pos = self.positions(grids)
        if pos.shape[0] != x.shape[0]:
            raise ValueError(f"{x.shape[0]} patches but the grids {grids} hold {pos.shape[0]}")
        return x + pos


class VisionTower(nn.Module):
    """``visual``: embeddings, the SigLIP encoder (one attention sequence per image or frame),
    ``post_layernorm``."""

    def __init__(self, config: ReasonerConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = SiglipEncoder(config.hidden_size, config.num_attention_heads, config.intermediate_size,
                                     config.num_hidden_layers, config.layer_norm_eps)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        return self.post_layernorm(self.encoder(self.embeddings(patches, grids), lengths))


class Projector(nn.Module):
    """``projector``: per-patch LayerNorm, the merge group's patches concatenated, a GELU MLP."""

    def __init__(self, config: ReasonerConfig) -> None:
        super().__init__()
        self.group = config.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(config.hidden_size * self.group, config.projector_hidden_size)
        self.linear_fc2 = nn.Linear(config.projector_hidden_size, config.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.group * x.shape[-1])
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Cosmos3Vision(nn.Module):
    """The reasoner's vision side: ``visual`` and ``projector``; ``forward`` gives one row per
    merged patch group (the media tokens' embeddings), images and frames in order."""

    def __init__(self, config: ReasonerConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTower(config)
        self.projector = Projector(config)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.projector(self.visual(patches, grids))

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.config.spatial_merge_size ** 2

    @staticmethod
    def read_config(root: Path, text_hidden_size: int) -> ReasonerConfig:
        path = Path(root) / "reasoner" / "config.json"
        if not path.exists():
            raise ValueError(f"{path} is missing: this checkpoint has no reasoner (only Cosmos3-Edge ships one)")
        return ReasonerConfig.from_dict(json.loads(path.read_text()), text_hidden_size)

    @classmethod
    def load(cls, root: Path, text_hidden_size: int, *, device, dtype, dummy: bool, seed: int) -> Cosmos3Vision:
        """The vision tower and projector from ``root/reasoner`` (``visual.*``, ``projector.*``;
        coverage checked both ways), or seeded random weights when ``dummy``."""
        from mstar.model.weights import building, fill_weights, iter_safetensors

        config = cls.read_config(root, text_hidden_size)
        with building(device, dtype):
            module = cls(config)
        return fill_weights(module, lambda: iter_safetensors(Path(root) / "reasoner"), dummy=dummy, seed=seed,
                            dtype=dtype)


# ------------------------------------------------------------------ preprocessing
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 frames: int = 1) -> tuple[int, int]:
    """The reference processor's target size: sides rounded to ``factor``, the area of all
    ``frames`` brought within ``[min_pixels, max_pixels]`` with the aspect ratio kept (temporal
    factor 1)."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_patches(image, config: ReasonerConfig, *, min_pixels: int | None = None,
                  max_pixels: int | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A PIL image -> its patches ``[h * w, p * p * 3]`` (block-major; each patch row, column,
    channel) and grid ``(1, h, w)``: RGB, bicubic resize to ``smart_resize``'s size, scaled to
    ``[-1, 1]`` (mean and std 0.5), as the reference's PIL image processor."""
    import numpy as np
    from PIL import Image

    p, m = config.patch_size, config.spatial_merge_size
    image = image.convert("RGB")
    height, width = smart_resize(image.height, image.width, p * m, min_pixels or config.min_pixels,
                                 max_pixels or config.max_pixels)
    if (width, height) != image.size:
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255.0
    return _normalized_patches(pixels[None], config), (1, height // p, width // p)


def _normalized_patches(pixels: torch.Tensor, config: ReasonerConfig) -> torch.Tensor:
    """``[T, 3, H, W]`` pixels in ``[0, 1]`` -> normalised block-major patches ``[T * h * w, p * p * 3]``."""
    p, m = config.patch_size, config.spatial_merge_size
    mean, std = torch.tensor(IMAGE_MEAN)[:, None, None], torch.tensor(IMAGE_STD)[:, None, None]
    pixels = (pixels - mean) / std
    t, _, height, width = pixels.shape
    gh, gw = height // p, width // p
    x = pixels.reshape(t, 3, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 4, 7, 1)
    return x.reshape(t * gh * gw, p * p * 3).contiguous()


def sample_frames(total: int, rate: float | None, fps: float, min_frames: int = 4, max_frames: int = 768) -> list[int]:
    """The reference video processor's frame choice: ``fps`` a second of the source ``rate``
    (24 when unknown), clamped to ``[min_frames, max_frames]`` and ``total``, evenly spread."""
    rate = rate or 24.0
    count = min(max(int(total / rate * fps), min_frames), max_frames, total)
    return [int(i) for i in torch.linspace(0, total - 1, count).round().tolist()]


def video_patches(frames, config: ReasonerConfig, *, min_pixels: int = 64 * 64,
                  max_pixels: int = 24 * 1024 * 1024) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Sampled uint8 frames ``[T, H, W, 3]`` -> patches (frame-major, each frame block-major) and
    grid ``(T, h, w)``: one size for all frames (``smart_resize`` over the whole clip's area,
    the video processor's ``size``), antialiased bicubic in uint8 as torchvision resizes on the
    CPU, normalised as images."""
    x = torch.as_tensor(frames).permute(0, 3, 1, 2).contiguous()
    t, _, height, width = x.shape
    p, m = config.patch_size, config.spatial_merge_size
    new_h, new_w = smart_resize(height, width, p * m, min_pixels, max_pixels, frames=t)
    if (new_h, new_w) != (height, width):
        x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    return _normalized_patches(x.float() / 255.0, config), (t, new_h // p, new_w // p)


def rope_positions(ids: torch.Tensor, grids: list[tuple[int, int, int]], media_ids: tuple[int, ...],
                   merge: int) -> torch.Tensor:
    """``[3, L]`` rotary positions of a prompt (the reference's ``get_rope_index``): each maximal
    run of media tokens takes the next grid (a video's frames one each); text advances by one."""
    is_media = torch.isin(ids, torch.tensor(media_ids, dtype=ids.dtype))
    frames = iter([(h, w) for t, h, w in grids for _ in range(t)])
    out, pos, i, n = [], 0, 0, len(ids)
    while i < n:
        j = i
        while j < n and bool(is_media[j]) == bool(is_media[i]):
            j += 1
        if not bool(is_media[i]):
            out.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
        else:
            h, w = next(frames)
            h, w = h // merge, w // merge
            if h * w != j - i:
                raise ValueError(f"a media run of {j - i} tokens at {i} does not match its grid ({h} x {w} merged)")
            rows = torch.arange(h).repeat_interleave(w) + pos
            cols = torch.arange(w).repeat(h) + pos
            out.append(torch.stack([torch.full((h * w,), pos), rows, cols]))
            pos += max(h, w)
        i = j
    return torch.cat(out, dim=1)


# ------------------------------------------------------------------ language model
class Cosmos3Reasoner(nn.Module):
    """The tower's understanding expert as a causal LM over paged KV. ``forward(embeds
    [T, D], positions [3, T], kv_caches, meta)``: the final-normed hidden states."""

    def __init__(self, tower: Cosmos3Transformer) -> None:
        super().__init__()
        self.tower = tower  # shared with the generator: the same parameters, not a copy
        c = tower.config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = c.head_dim ** -0.5

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tower.embed_tokens(ids)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: PagedAttentionMetadata) -> torch.Tensor:
        cos, sin = self.tower.rope.cos_sin(positions.to(embeds.device), embeds.dtype)
        cos, sin = cos[:, None], sin[:, None]
        x, rows = embeds, embeds.shape[0]
        for layer, kv_cache in zip(self.tower.layers, kv_caches, strict=True):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.norm_q(attn.to_q(h).view(rows, self.heads, self.head_dim))
            k = attn.norm_k(attn.to_k(h).view(rows, self.kv_heads, self.head_dim))
            v = attn.to_v(h).view(rows, self.kv_heads, self.head_dim)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            out = paged_attention(q, k.contiguous(), v.contiguous(), kv_cache, meta, self.scale)
            x = x + attn.to_out(out.flatten(1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.tower.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tower.lm_head(hidden)

    def cache_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the paged KV cache."""
        return self.tower.config.num_hidden_layers, self.kv_heads, self.head_dim


class ReasonerForward(Forward):
    """The chat engine's forward: a prefill with media splices the vision node's
    ``vision_embeds`` over its media tokens and runs at its ``rope_positions`` ``[3, L]``; its
    decodes then run at ``cache index + delta``. Text-only prompts run at cache positions."""

    runs_ahead = False
    kv_from_tokens = False  # a media token's K/V depend on its pixels
    preemptible = False  # the vision embeddings are read by the prefill only

    def __init__(self, model: Cosmos3Reasoner, media_ids: tuple[int, ...]) -> None:
        super().__init__(model)
        self.graph_rows = None
        self.media_ids = media_ids
        self.deltas: dict[str, int] = {}

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        positions = meta.positions[None].repeat(3, 1)
        embeds = self.model.embed(input_ids)
        bounds = meta.query_starts
        media = torch.tensor(self.media_ids, dtype=input_ids.dtype, device=input_ids.device)
        for row, item in enumerate(items):
            lo, hi = bounds[row], bounds[row + 1]
            given = item.inputs.get("rope_positions") if item.op == "prefill" else None
            if given is None:
                positions[:, lo:hi] += self.deltas.get(item.request_id, 0)
                continue
            start = int(meta.positions[lo])
            if start:
                raise ValueError(f"request {item.request_id}: a media prompt is prefilled in one chunk")
            positions[:, lo:hi] = given[:, :hi - lo].to(positions.device)
            self.deltas[item.request_id] = int(given.max()) + 1 - given.shape[1]
            vision = item.inputs.get("vision_embeds")
            if vision is not None:
                mask = torch.isin(input_ids[lo:hi], media)
                if int(mask.sum()) != vision.shape[0]:
                    raise ValueError(f"request {item.request_id}: {int(mask.sum())} media tokens but "
                                     f"{vision.shape[0]} vision embeddings")
                embeds[lo:hi][mask] = vision.to(embeds.device, embeds.dtype)
        return {"embeds": embeds, "positions": positions}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        return self.model(inputs["embeds"], inputs["positions"], kv_caches, meta)

    def release(self, request_id: str) -> None:
        self.deltas.pop(request_id, None)


def vision_fn(vision: Cosmos3Vision):
    """The vision node: every item's images and frames in one forward; each item gets back its
    own rows (``vision_embeds``), in prompt order."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = vision.projector.linear_fc1.weight
        grids = [[tuple(g) for g in item.inputs["grid_thw"].reshape(-1, 3).tolist()] for item in items]
        patches = torch.cat([item.inputs["pixel_values"] for item in items]).to(weight.device, weight.dtype)
        with torch.inference_mode():
            embeds = vision(patches, [g for per in grids for g in per])
        sizes = [sum(vision.num_tokens(g) for g in per) for per in grids]
        return [{"vision_embeds": part} for part in embeds.split(sizes)]

    return run


def reasoner_engines(root: Path, tower: Cosmos3Transformer | None, nodes: set[str], config, seed: int,
                     device: torch.device, attention_backend: str = "torch") -> dict[str, Any]:
    """``vision`` (the checkpoint's ``reasoner/`` tower; without the folder a node that refuses)
    and ``llm`` (the reasoner over ``tower``, the generator's instance) for those in ``nodes``."""
    from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
    from mstar.engine.base import StatelessEngine
    from mstar.model.cosmos3.config import Cosmos3Config

    text = Cosmos3Config.from_dict(json.loads((Path(root) / "transformer" / "config.json").read_text()))
    has_folder = (Path(root) / "reasoner" / "config.json").exists()
    reasoner_config = Cosmos3Vision.read_config(root, text.hidden_size) if has_folder else ReasonerConfig()
    engines: dict[str, Any] = {}
    if "vision" in nodes:
        if has_folder:
            vision = Cosmos3Vision.load(root, text.hidden_size, device=device, dtype=config.torch_dtype(),
                                        dummy=config.load_format == "dummy", seed=seed + 3)
            engines["vision"] = StatelessEngine(vision_fn(vision))
        else:
            def refuse(op, items):
                raise ValueError("this Cosmos3 checkpoint has no reasoner/ folder (no vision tower)")

            engines["vision"] = StatelessEngine(refuse)
    if "llm" in nodes:
        if tower is None:
            raise ValueError("the llm node needs the tower")
        model = Cosmos3Reasoner(tower)
        kv = config.resources.kv_cache
        forward = ReasonerForward(model, (reasoner_config.image_token_id, reasoner_config.video_token_id))
        engines["llm"] = AutoregressiveEngine(model, KVLayout(*model.cache_shape()), num_pages=kv.max_num_pages,
                                              page_size=kv.page_size, max_seq_len=config.max_seq_len, device=device,
                                              dtype=config.torch_dtype(), forward=forward,
                                              attention_backend=attention_backend)
    return engines
