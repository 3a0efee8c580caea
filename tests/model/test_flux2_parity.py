"""Parity of the FLUX.2 transformer against diffusers' ``Flux2Transformer2DModel``.

A tiny random config in float32 on CPU: the reference model gets seeded, scaled-up weights and
its state dict loads strictly into ours (parameter names are equal). Checked: rotary tables,
one double-stream block, one single-stream block and the full forward (batch of 2 with
different timesteps, with and without a guidance embedder, 2x2 and 4x4 latent grids).
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from diffusers.models.embeddings import apply_rotary_emb

from mstar.layers.rotary import apply_rotary_pairs as apply_rope
from mstar.model.flux2 import (
    PRESETS,
    Flux2Transformer,
    Flux2TransformerConfig,
)

TOL = 1e-5
N_TXT = 5
TINY = dict(
    patch_size=1,
    in_channels=8,
    out_channels=None,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=12,
    timestep_guidance_channels=32,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    rope_theta=2000,
    eps=1e-6,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = rel_err(ours, ref)
    print(f"{name}: rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights, larger than the default init so every path moves the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:  # RMSNorm gains
                p.copy_(1.0 + 0.5 * noise)
            else:
                p.copy_(noise * 2.0 / math.sqrt(p.shape[1]))


def text_ids(n: int) -> torch.Tensor:
    """Pipeline layout ``(t, h, w, l) = (0, 0, 0, i)``."""
    ids = torch.zeros(n, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(n)
    return ids


def image_ids(h: int, w: int) -> torch.Tensor:
    """Pipeline layout ``(0, row, col, 0)``."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))


@pytest.fixture(scope="module", params=[True, False], ids=["guidance", "no_guidance"])
def models(request) -> tuple[Flux2Transformer2DModel, Flux2Transformer]:
    ref = Flux2Transformer2DModel(**TINY, guidance_embeds=request.param).eval()
    randomize(ref, seed=1234)
    ours = Flux2Transformer(Flux2TransformerConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def test_parameter_names_equal_reference_keys(models) -> None:
    ref, ours = models
    ref_shapes = {k: v.shape for k, v in ref.state_dict().items()}
    our_shapes = {k: p.shape for k, p in ours.named_parameters()}
    assert our_shapes == ref_shapes
    assert dict(ours.named_buffers()) == {}


def test_config_from_dict_and_presets() -> None:
    ref = Flux2Transformer2DModel(**TINY)
    cfg = Flux2TransformerConfig.from_dict(dict(ref.config))
    assert cfg.to_dict() == {**TINY, "axes_dims_rope": [4, 4, 4, 4], "guidance_embeds": True}
    with pytest.raises(ValueError, match="unknown"):
        Flux2TransformerConfig.from_dict({"pooled_projection_dim": 768})
    assert Flux2TransformerConfig() == Flux2TransformerConfig.from_dict(
        {"_class_name": "Flux2Transformer2DModel", "_diffusers_version": "0.42.1"}
    )
    assert PRESETS["flux2-klein-4b"].inner_dim == 3072
    assert PRESETS["flux2-klein-9b"].inner_dim == 4096
    assert Flux2TransformerConfig.preset("flux2-klein-9b") is not PRESETS["flux2-klein-9b"]


def test_rope(models) -> None:
    ref, ours = models
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat([text_ids(N_TXT), image_ids(4, 4), torch.randint(0, 64, (7, 4), generator=gen)])
    cos, sin = ours.pos_embed(ids)
    ref_cos, ref_sin = ref.pos_embed(ids)
    check("rope cos", cos, ref_cos)
    check("rope sin", sin, ref_sin)
    x = torch.randn(2, ids.shape[0], 2, 16, generator=gen)
    expected = apply_rotary_emb(x, (ref_cos, ref_sin), sequence_dim=1)
    check("rope apply", apply_rope(x, cos, sin), expected)


def _block_inputs(ref, grid: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dim = ref.inner_dim
    img = torch.randn(2, grid * grid, dim, generator=gen)
    txt = torch.randn(2, N_TXT, dim, generator=gen)
    temb = torch.randn(2, dim, generator=gen)
    ids = torch.cat([text_ids(N_TXT), image_ids(grid, grid)])
    return img, txt, temb, ids


@pytest.mark.parametrize("grid", [2, 4])
@torch.no_grad()
def test_double_stream_block(models, grid: int) -> None:
    ref, ours = models
    img, txt, temb, ids = _block_inputs(ref, grid, seed=grid)
    mod_img = ref.double_stream_modulation_img(temb)
    mod_txt = ref.double_stream_modulation_txt(temb)
    ref_txt, ref_img = ref.transformer_blocks[1](img, txt, mod_img, mod_txt, ref.pos_embed(ids))
    our_img, our_txt = ours.transformer_blocks[1](img, txt, mod_img, mod_txt, ours.pos_embed(ids))
    check(f"double block img {grid}x{grid}", our_img, ref_img)
    check(f"double block txt {grid}x{grid}", our_txt, ref_txt)


@pytest.mark.parametrize("grid", [2, 4])
@torch.no_grad()
def test_single_stream_block(models, grid: int) -> None:
    ref, ours = models
    img, txt, temb, ids = _block_inputs(ref, grid, seed=10 + grid)
    x = torch.cat([txt, img], dim=1)
    mod = ref.single_stream_modulation(temb)
    expected = ref.single_transformer_blocks[1](x, None, mod, ref.pos_embed(ids))
    out = ours.single_transformer_blocks[1](x, mod, ours.pos_embed(ids))
    check(f"single block {grid}x{grid}", out, expected)


@pytest.mark.parametrize("grid", [2, 4])
@torch.no_grad()
def test_full_forward(models, grid: int) -> None:
    ref, ours = models
    gen = torch.Generator().manual_seed(100 + grid)
    latents = torch.randn(2, grid * grid, ref.config.in_channels, generator=gen)
    text = torch.randn(2, N_TXT, ref.config.joint_attention_dim, generator=gen)
    timestep = torch.tensor([0.3, 0.85])
    img_ids, txt_ids = image_ids(grid, grid), text_ids(N_TXT)
    guidances = [torch.tensor([3.5, 1.0]), None] if ref.config.guidance_embeds else [None]

    for guidance in guidances:
        tag = f"forward {grid}x{grid} guidance={'on' if guidance is not None else 'off'}"
        expected = ref(latents, text, timestep, img_ids, txt_ids, guidance, return_dict=False)[0]
        check(tag, ours(latents, text, timestep, img_ids, txt_ids, guidance), expected)
        # The two samples differ in timestep (and guidance); that path must move the output.
        assert rel_err(expected[0], expected[1]) > 1e-2

        # Per-sample ids that agree across the batch give the same result as shared ids.
        batched = ours(
            latents, text, timestep, img_ids.expand(2, -1, -1), txt_ids.expand(2, -1, -1), guidance
        )
        check(f"{tag} batched ids", batched, expected)
