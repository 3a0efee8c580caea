"""BAGEL's image reader: a SigLIP NaViT tower over images of any size, a connector MLP into
the LLM's width, and a fixed 2D sine-cosine table added there.

An image (``[3, H, W]``, both sides multiples of the patch) becomes ``(H / p) * (W / p)``
patches, each flattened in ``(row, column, channel)`` order (``patchify``): the tower's patch
embedding is a linear layer over that vector (the released checkpoint stores it so). A patch
at grid cell ``(r, c)`` has the flattened position ``r * max_side + c`` (``max_side`` =
``vit_max_num_patch_per_side``, 70 for BAGEL-7B), which indexes both the tower's learned
position table and the LLM-side ``vit_pos_embed``. Several images run in one forward,
packed, each attending to its own patches only.

Parameter names are the released checkpoint's: ``vit_model.vision_model.…``,
``connector.fc1 / fc2``, ``vit_pos_embed.pos_embed``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.bagel.config import BagelConfig, BagelVisionConfig
from mstar.model.siglip import SiglipEncoder


def patchify(image: torch.Tensor, patch: int) -> torch.Tensor:
    """``[C, H, W]`` -> ``[(H/p) * (W/p), p * p * C]``, patches in raster order, each flattened
    as ``(row in patch, column in patch, channel)``."""
    c, h, w = image.shape
    if h % patch or w % patch:
        raise ValueError(f"image sides {h}x{w} are not multiples of the patch size {patch}")
    grid = image.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 2, 4, 0)
    return grid.reshape(-1, patch * patch * c)


def patch_positions(height: int, width: int, patch: int, max_side: int) -> torch.Tensor:
    """Flattened positions ``[(H/p) * (W/p)]`` of an image's patches: ``row * max_side + col``."""
    rows, cols = height // patch, width // patch
    if rows > max_side or cols > max_side:
        raise ValueError(f"an image of {rows}x{cols} patches exceeds the {max_side}x{max_side} position grid")
    return (torch.arange(rows)[:, None] * max_side + torch.arange(cols)[None, :]).flatten()


def sincos_table(side: int, dim: int) -> torch.Tensor:
    """The fixed 2D sine-cosine table ``[side * side, dim]`` of BAGEL's position embeddings
    (computed in float64, stored as float32): for the cell ``(r, c)``, the first half encodes
    the column ``c`` and the second the row ``r``, each half ``[sin(pos * w), cos(pos * w)]`` with frequencies
    ``w_k = 10000^(-k / (dim / 4))``."""
    quarter = dim // 4
    freqs = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coords = torch.arange(side, dtype=torch.float64)
    rows, cols = coords.repeat_interleave(side), coords.repeat(side)

    def encode(pos: torch.Tensor) -> torch.Tensor:
        angles = pos[:, None] * freqs[None, :]
        return torch.cat((angles.sin(), angles.cos()), dim=1)

    return torch.cat((encode(cols), encode(rows)), dim=1).float()


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: BagelVisionConfig) -> None:
        super().__init__()
        patch_dim = config.num_channels * config.patch_size ** 2
        self.patch_embedding = nn.Linear(patch_dim, config.hidden_size)
        self.position_embedding = nn.Embedding(config.num_positions, config.hidden_size)


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: BagelVisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config.hidden_size, config.num_attention_heads, config.intermediate_size,
                                     config.num_hidden_layers, config.layer_norm_eps)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.embeddings.patch_embedding(patches) + self.embeddings.position_embedding(positions)
        return self.post_layernorm(self.encoder(x, lengths))


class SiglipVisionModel(nn.Module):
    """``vit_model``: the tower, under its released prefix ``vision_model``."""

    def __init__(self, config: BagelVisionConfig) -> None:
        super().__init__()
        self.vision_model = SiglipVisionTransformer(config)


class MLPConnector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, out_dim)
        self.fc2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class PositionTable(nn.Module):
    """A fixed ``[side * side, dim]`` table read by flattened position (``pos_embed``).

    BAGEL computes it when the model is built and never trains it; some checkpoints store it
    and some do not, so it is a buffer made here, never read from the checkpoint
    (``checkpoint.FIXED_TABLES``)."""

    def __init__(self, side: int, dim: int) -> None:
        super().__init__()
        # float32 (from float64), then the model's dtype: what building in float32 and casting gave
        self.register_buffer("pos_embed", sincos_table(side, dim).to(torch.get_default_dtype()), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[positions]


class BagelVision(nn.Module):
    """Images to LLM tokens: ``forward(patches, positions, lengths)`` takes the packed patches
    ``[N, p * p * C]`` of several images, their flattened positions ``[N]`` and the patch count
    of each image, and returns one LLM-width embedding per patch ``[N, hidden]``."""

    def __init__(self, config: BagelConfig) -> None:
        super().__init__()
        self.config = config
        self.vit_model = SiglipVisionModel(config.vision)
        self.connector = MLPConnector(config.vision.hidden_size, config.llm.hidden_size)
        self.vit_pos_embed = PositionTable(config.vit_max_num_patch_per_side, config.llm.hidden_size)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        features = self.vit_model.vision_model(patches, positions, lengths)
        return self.connector(features) + self.vit_pos_embed(positions)

    def image_tokens(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One preprocessed image ``[3, H, W]`` as ``(patches, positions)``."""
        patch = self.config.vision.patch_size
        return (patchify(image, patch),
                patch_positions(image.shape[1], image.shape[2], patch, self.config.vit_max_num_patch_per_side))


# ------------------------------------------------------------------ preprocessing
VAE_RESIZE = (1024, 512)
"""The first resize of an input image, (longest side at most, shortest side at least), sides
multiples of 16: the generation side's, which the reference's inferencer applies to every
image, understanding included."""
VAE_STRIDE = 16
VIT_RESIZE = (980, 224)
"""The tower's resize, sides multiples of its patch: up to 70 x 70 patches of 14."""
MAX_PIXELS = 14 * 14 * 9 * 1024


def resized_size(width: int, height: int, max_size: int, min_size: int, stride: int,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """BAGEL's ``(width, height)`` for an image: scaled so that its longest side is at most
    ``max_size`` and then its shortest at least ``min_size``, its area at most ``max_pixels``,
    each side rounded to a multiple of ``stride`` (at least one stride)."""
    def scaled(w: int, h: int, scale: float) -> tuple[int, int]:
        return (max(stride, int(round(round(w * scale) / stride) * stride)),
                max(stride, int(round(round(h * scale) / stride) * stride)))

    scale = max(min(max_size / max(width, height), 1.0), min_size / min(width, height))
    w, h = scaled(width, height, scale)
    if w * h > max_pixels:
        w, h = scaled(w, h, max_pixels / (w * h))
    if max(w, h) > max_size:
        w, h = scaled(w, h, max_size / max(w, h))
    return w, h


def preprocess(image, patch: int, vit_resize: tuple[int, int] = VIT_RESIZE,
               vae_resize: tuple[int, int] = VAE_RESIZE) -> torch.Tensor:
    """A PIL image as the tower reads it: RGB (transparency over white), resized twice as the
    reference's inferencer does (``vae_resize`` with sides multiples of 16, then ``vit_resize``
    with sides multiples of ``patch``; bicubic), scaled to ``[-1, 1]``: ``[3, H, W]`` float32."""
    import numpy as np
    from PIL import Image

    if image.mode == "RGBA" or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.new("RGB", rgba.size, (255, 255, 255))
        image.paste(rgba, mask=rgba.split()[3])
    else:
        image = image.convert("RGB")
    for (max_size, min_size), stride in ((vae_resize, VAE_STRIDE), (vit_resize, patch)):
        size = resized_size(*image.size, max_size, min_size, stride)
        if size != image.size:
            image = image.resize(size, Image.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (pixels - 0.5) / 0.5
