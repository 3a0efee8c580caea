"""Parity of the Z-Image DiT against diffusers' ``ZImageTransformer2DModel`` on a tiny random
config in float32 on the CPU: rotary tables, one modulated and one unmodulated block, and the
whole transformer on batches that mix caption lengths (below, at and above a multiple of 32)
and image sizes (token counts that need padding), each row also against its solo run."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import ZImageTransformer2DModel
from diffusers.models.transformers.transformer_z_image import (
    RopeEmbedder,
    ZImageTransformerBlock,
)

from mstar.model.weights import load_weights
from mstar.model.z_image.config import ZImageTransformerConfig
from mstar.model.z_image.transformer import ZImageBlock, ZImageTransformer, rope_cos_sin

TOL = 1e-5
TINY = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
            n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=24,
            rope_theta=256.0, t_scale=1000.0, axes_dims=(4, 6, 6), axes_lens=(128, 32, 32))


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights larger than the default init (pad tokens too), so every path moves the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif p.ndim == 1 or "pad_token" in name:
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise * 1.5 / math.sqrt(p.shape[1]))


@pytest.fixture(scope="module")
def models():
    ref = ZImageTransformer2DModel(**TINY).eval()
    randomize(ref, 0)
    ours = ZImageTransformer(ZImageTransformerConfig.from_dict(dict(ref.config))).eval()
    load_weights(ours, ref.state_dict().items())  # same names, coverage checked both ways
    return ref, ours


def test_rope_table_matches_diffusers():
    ref = RopeEmbedder(theta=256.0, axes_dims=[4, 6, 6], axes_lens=[64, 16, 16])
    ids = torch.stack([torch.randint(0, n, (50,)) for n in (64, 16, 16)], dim=1)
    cos, sin = rope_cos_sin(ids, (4, 6, 6), 256.0)
    want = ref(ids)
    check("rope cos", cos, want.real)
    check("rope sin", sin, want.imag)


@pytest.mark.parametrize("modulation", [True, False])
def test_block(modulation):
    cfg = ZImageTransformerConfig.from_dict(TINY)
    torch.manual_seed(1)
    ref = ZImageTransformerBlock(0, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps, cfg.qk_norm,
                                 modulation=modulation).eval()
    randomize(ref, 1)
    ours = ZImageBlock(cfg, modulation).eval()
    load_weights(ours, ref.state_dict().items())
    x = torch.randn(2, 7, cfg.dim)
    ids = torch.stack([torch.randint(0, 20, (2, 7)) for _ in range(3)], dim=-1)
    cos, sin = rope_cos_sin(ids.flatten(0, 1), cfg.axes_dims, cfg.rope_theta)
    cos, sin = cos.view(2, 7, -1), sin.view(2, 7, -1)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    adaln = torch.randn(2, cfg.adaln_dim) if modulation else None
    with torch.no_grad():
        want = ref(x, mask, torch.polar(torch.ones_like(cos), torch.atan2(sin, cos)), adaln)
        got = ours(x, (cos, sin), mask, adaln)
    check(f"block modulation={modulation}", got[0], want[0])
    check(f"block modulation={modulation} (masked row)", got[1, :4], want[1, :4])


def test_whole_transformer_batch_of_caption_lengths(models):
    ref, ours = models
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(3, 4, 12, 10, generator=gen)  # 6 x 5 = 30 tokens: padded to 32
    captions = [torch.randn(n, 24, generator=gen) for n in (5, 37, 32)]
    t = torch.tensor([0.1, 0.5, 0.93])
    with torch.no_grad():
        want = ref(list(latents.unsqueeze(2)), t, captions, return_dict=False)[0]
        got = ours(latents, t, captions)
        for i in range(3):
            check(f"transformer row {i}", got[i], want[i].squeeze(1))
            solo = ours(latents[i : i + 1], t[i : i + 1], captions[i : i + 1])
            check(f"transformer row {i} solo", solo[0], got[i])


def test_whole_transformer_mixed_image_sizes(models):
    ref, ours = models
    gen = torch.Generator().manual_seed(4)
    latents = [torch.randn(4, 16, 16, generator=gen), torch.randn(4, 8, 14, generator=gen)]
    captions = [torch.randn(n, 24, generator=gen) for n in (9, 40)]
    t = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        want = ref([x.unsqueeze(1) for x in latents], t, captions, return_dict=False)[0]
        got = ours(latents, t, captions)
    for i in range(2):
        check(f"mixed sizes row {i}", got[i], want[i].squeeze(1))


def test_checkpoint_names_equal_diffusers(models):
    ref, ours = models
    assert set(ours.state_dict()) == set(ref.state_dict())


def test_bfloat16_matches_diffusers_in_bfloat16(models):
    ref, ours = (m.to(torch.bfloat16) for m in (ZImageTransformer2DModel(**TINY).eval(),
                                                ZImageTransformer(ZImageTransformerConfig.from_dict(TINY)).eval()))
    randomize(ref, 0)
    load_weights(ours, ref.state_dict().items())
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(2, 4, 12, 10, generator=gen).bfloat16()
    captions = [torch.randn(n, 24, generator=gen).bfloat16() for n in (5, 40)]
    t = torch.tensor([0.2, 0.9])  # float32, as the pipeline passes it
    with torch.no_grad():
        want = ref(list(latents.unsqueeze(2)), t, captions, return_dict=False)[0]
        got = ours(latents, t, captions)
    assert got.dtype == torch.bfloat16
    for g, w in zip(got.float(), want):
        w = w.squeeze(1).float()
        assert (g - w).abs().max() <= 1e-2 * w.abs().max()  # same roundings; bit-equal on this CPU
