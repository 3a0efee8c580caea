"""BAGEL's VAE: FLUX.1's autoencoder (images <-> 16-channel latents at 1/8 resolution), read from
BAGEL's ``ae.safetensors``, which keeps Black Forest Labs' original key layout.

The network is the one ``ZImageVAE`` already is (diffusers' ``AutoencoderKL`` without quant
convolutions): the maths is the same, only the names differ, so this module is a key map onto it,
not a second VAE. ``from_original_layout`` renames the original keys (``encoder.down.0.block.1``,
``mid.attn_1.q``, ``decoder.up.3`` ...) to ours and turns the mid attention's 1x1 convolutions
into the linear layers diffusers uses (the same matrices).

BAGEL works on normalised latents, ``scale * (z - shift)``: ``encode`` returns them (the
posterior's mean, or a sample of it when given the noise: BAGEL's editing samples), ``decode``
takes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from mstar.model.flux2.vae import Flux2VAEConfig
from mstar.model.z_image.vae import ZImageVAE, ZImageVAEConfig

__all__ = ["config_from_shapes", "decode", "encode", "flux1_vae_config", "from_original_layout", "original_name"]

AE_FILE = "ae.safetensors"  # the VAE's file in the BAGEL-7B-MoT repository

_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_MID = re.compile(r"(encoder|decoder)\.mid\.(block_1|block_2|attn_1)\.(\w+)\.(weight|bias)")
_RESNET = re.compile(r"(encoder\.down|decoder\.up)\.(\d+)\.block\.(\d+)\.(\w+)\.(weight|bias)")
_RESAMPLE = re.compile(r"(encoder\.down|decoder\.up)\.(\d+)\.(downsample|upsample)\.conv\.(weight|bias)")


def flux1_vae_config(ch: int = 128, ch_mult: tuple[int, ...] = (1, 2, 4, 4), num_res_blocks: int = 2,
                     z_channels: int = 16, scale_factor: float = 0.3611,
                     shift_factor: float = 0.1159) -> ZImageVAEConfig:
    """The VAE from the original ``AutoEncoderParams`` (defaults: BAGEL's ``load_ae``, FLUX.1's).
    The original normalises with 32 groups everywhere, so ``ch`` must be a multiple of 32."""
    if ch % 32:
        raise ValueError(f"ch {ch} is not a multiple of the 32 GroupNorm groups")
    net = Flux2VAEConfig(block_out_channels=tuple(ch * m for m in ch_mult), layers_per_block=num_res_blocks,
                         latent_channels=z_channels, norm_num_groups=32, use_quant_conv=False,
                         use_post_quant_conv=False)
    return ZImageVAEConfig(net, scaling_factor=scale_factor, shift_factor=shift_factor)


def config_from_shapes(shapes: Mapping[str, Sequence[int]]) -> ZImageVAEConfig:
    """The VAE an ``ae.safetensors`` holds, read off its tensors' shapes (``{name: shape}``): the
    base width, the resolutions' widths, blocks per resolution and latent channels. The latent
    normalisation is not in the file: FLUX.1's, as BAGEL's ``load_ae`` hard-codes it."""
    try:
        ch = shapes["encoder.conv_in.weight"][0]
        levels = 1 + max(int(m.group(1)) for k in shapes if (m := re.match(r"encoder\.down\.(\d+)\.", k)))
        blocks = 1 + max(int(m.group(1)) for k in shapes if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k)))
        widths = [shapes[f"encoder.down.{i}.block.0.conv1.weight"][0] for i in range(levels)]
        z_channels = shapes["decoder.conv_in.weight"][1]
    except (KeyError, ValueError) as err:
        raise ValueError(f"not a FLUX autoencoder in the original layout (no {err})") from None
    return flux1_vae_config(ch, tuple(w // ch for w in widths), blocks, z_channels)


def original_name(name: str, levels: int) -> str:
    """Our (diffusers') name for the original key ``name`` of a VAE with ``levels`` resolutions;
    a key that is not the original layout's comes back unchanged (so coverage names it)."""
    if m := _MID.fullmatch(name):
        side, part, layer, kind = m.groups()
        if part == "attn_1":
            return f"{side}.mid_block.attentions.0.{_ATTN.get(layer, layer)}.{kind}"
        return f"{side}.mid_block.resnets.{int(part[-1]) - 1}.{layer}.{kind}"
    if m := _RESNET.fullmatch(name):
        where, level, block, layer, kind = m.groups()
        layer = "conv_shortcut" if layer == "nin_shortcut" else layer
        return f"{_stage(where, int(level), levels)}.resnets.{block}.{layer}.{kind}"
    if m := _RESAMPLE.fullmatch(name):
        where, level, resample, kind = m.groups()
        return f"{_stage(where, int(level), levels)}.{resample}rs.0.conv.{kind}"
    side, _, rest = name.partition(".")
    if side in ("encoder", "decoder") and rest.startswith("norm_out."):
        return f"{side}.conv_norm_out.{rest.removeprefix('norm_out.')}"
    return name


def _stage(where: str, level: int, levels: int) -> str:
    # The original decoder indexes its stages by resolution (up.0 is the last, full-size one);
    # diffusers by the order they run.
    if where == "encoder.down":
        return f"encoder.down_blocks.{level}"
    return f"decoder.up_blocks.{levels - 1 - level}"


def from_original_layout(tensors: Iterable[tuple[str, torch.Tensor]],
                         levels: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``ae.safetensors``' ``(name, tensor)`` pairs as ``ZImageVAE``'s: renamed, and the mid
    attention's ``[C, C, 1, 1]`` convolution kernels as ``[C, C]`` matrices."""
    for name, tensor in tensors:
        ours = original_name(name, levels)
        if ".attentions.0.to_" in ours and ours.endswith(".weight") and tensor.dim() == 4:
            tensor = tensor.reshape(tensor.shape[0], tensor.shape[1])
        yield ours, tensor


def encode(vae: ZImageVAE, images: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` in ``[-1, 1]`` -> BAGEL's latents ``scale * (z - shift)``, ``z``
    the posterior's mean, or ``mean + std * noise`` (``noise`` shaped like the mean)."""
    moments = vae.encoder(images)
    if vae.quant_conv is not None:
        moments = vae.quant_conv(moments)
    mean, logvar = moments.chunk(2, dim=1)
    z = mean if noise is None else mean + torch.exp(0.5 * logvar) * noise
    return vae.normalize(z)


def decode(vae: ZImageVAE, latents: torch.Tensor) -> torch.Tensor:
    """BAGEL's latents ``[B, C, h, w]`` -> images ``[B, 3, 8h, 8w]`` (nominally in ``[-1, 1]``)."""
    return vae.decode(vae.denormalize(latents))
