"""Parity of the Wan DiT against diffusers' ``WanTransformer3DModel`` on a tiny random config of
the TI2V-5B shape (48-channel latents, no image branch) in float32 on the CPU: one time per row
and one time per token (TI2V's ``expand_timesteps``, the first latent frame at time 0)."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from mstar.model.wan22.config import WanTransformerConfig
from mstar.model.wan22.transformer import WanTransformer
from tests.support.diffusers_dirs import randomize

TOL = 1e-5
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=8, out_channels=8,
            text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


@pytest.fixture(scope="module")
def models():
    ref = WanTransformer3DModel(**TINY).eval()
    randomize(ref, 0, spread=0.3, weight_gain=1.5)
    ours = WanTransformer(WanTransformerConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def test_state_dict_keys_match(models):
    ours, ref = models
    assert set(ours.state_dict()) == set(ref.state_dict())


def test_rope_dims_follow_diffusers(models):
    _, ref = models
    assert WanTransformerConfig(**TINY).rope_dims == (ref.rope.t_dim, ref.rope.h_dim, ref.rope.w_dim)


@pytest.mark.parametrize("per_token", [False, True])
def test_transformer_parity(models, per_token):
    ours, ref = models
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 8, 3, 4, 6, generator=gen)
    text = torch.randn(2, 7, 16, generator=gen)
    t = torch.tensor([999.0, 421.5])
    if per_token:  # TI2V: the first latent frame clean (time 0), the rest at the row's time
        mask = torch.ones(2, 3, 2, 3)
        mask[:, 0] = 0
        t = (mask * t[:, None, None, None]).flatten(1)
    with torch.no_grad():
        want = ref(latents, t, text, return_dict=False)[0]
        got = ours(latents, t, text)
    check(f"dit per_token={per_token}", got, want)


def test_refuses_image_branch():
    with pytest.raises(ValueError, match="image_dim"):
        WanTransformerConfig(image_dim=1280)
