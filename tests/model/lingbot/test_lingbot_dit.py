"""LingBot-World's causal DiT on a tiny random config, float32 on the CPU: parity of its Wan
blocks against diffusers' ``WanTransformer3DModel`` (no camera, no cache), the camera
patchifying against einops on the reference's pattern, and the rollout invariants: chunks
committed one by one through the rolling cache give what one pass over the whole video gives
under the block-causal mask (with and without a window and a sink), and a denoising forward
leaves the cache alone."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel
from einops import rearrange

from mstar.model.lingbot.cache import block_causal_mask
from mstar.model.lingbot.config import LingbotConfig
from mstar.model.lingbot.sampler import Rollout, denoise_chunk, distilled_schedule
from mstar.model.lingbot.transformer import LingbotTransformer
from mstar.model.wan22.config import WanTransformerConfig
from tests.support.diffusers_dirs import randomize

TOL = 1e-5
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12, out_channels=4,
            text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)


def tiny(**kw) -> LingbotConfig:
    return LingbotConfig(dit=WanTransformerConfig(**TINY), vae_stride=(4, 2, 2), chunk_frames=2, **kw)


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


def make_dit(config: LingbotConfig, seed: int = 0) -> LingbotTransformer:
    dit = LingbotTransformer(config).eval()
    randomize(dit, seed, spread=0.3, weight_gain=1.5)
    return dit


def inputs(frames: int, gen: torch.Generator, config: LingbotConfig):
    x = torch.randn(1, config.dit.in_channels, frames, 4, 6, generator=gen)
    text = torch.randn(1, 7, 16, generator=gen)
    camera = torch.randn(1, config.camera_channels, frames, 4, 6, generator=gen)
    return x, text, camera


def test_wan_parts_match_diffusers():
    ref = WanTransformer3DModel(**TINY).eval()
    randomize(ref, 0, spread=0.3, weight_gain=1.5)
    ours = LingbotTransformer(tiny()).eval()
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected
    assert missing and all("cam" in k or "c2ws" in k for k in missing), missing
    gen = torch.Generator().manual_seed(1)
    x, text, _ = inputs(3, gen, tiny())
    for t in (999.0, 250.0, 0.0):
        with torch.no_grad():
            want = ref(x, torch.tensor([t]), text, return_dict=False)[0]
            got = ours(x, torch.tensor([t]), text)
        check(f"dit t={t}", got, want)


def test_camera_patchify_follows_the_reference_pattern():
    config = tiny()
    dit = make_dit(config)
    rays = torch.randn(2, config.camera_channels, 3, 4, 6, generator=torch.Generator().manual_seed(2))
    flat = rearrange(rays, "b c (f c1) (h c2) (w c3) -> b (f h w) (c c1 c2 c3)", c1=1, c2=2, c3=2)
    emb = dit.camera_embedder
    with torch.no_grad():
        e = emb.patch_embedding_wancamctrl(flat)
        want = e + emb.c2ws_hidden_states_layer2(torch.nn.functional.silu(emb.c2ws_hidden_states_layer1(e)))
        check("camera embedding", emb(rays), want, tol=0.0)


def test_camera_moves_the_output():
    config = tiny()
    dit = make_dit(config)
    x, text, camera = inputs(2, torch.Generator().manual_seed(3), config)
    with torch.no_grad():
        a = dit(x, torch.tensor([500.0]), text, camera)
        b = dit(x, torch.tensor([500.0]), text, camera.flip(1))
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize(("window", "sink"), [(None, 0), (4, 0), (5, 1)])
def test_chunked_rollout_equals_block_causal_pass(window, sink):
    """Clean chunks committed one by one (time 0, as after denoising) == one pass over all 8
    frames under the block-causal mask; the window drops the oldest non-sink frames."""
    config = tiny(window_frames=window, sink_frames=sink)
    dit = make_dit(config, seed=4)
    frames, chunk = 8, config.chunk_frames
    x, text, camera = inputs(frames, torch.Generator().manual_seed(5), config)
    t0 = torch.tensor([0.0])
    mask = block_causal_mask(frames, 6, chunk, window, sink)
    with torch.no_grad():
        want = dit(x, t0, text, camera, mask=mask)
        cache = dit.new_cache()
        got = torch.cat([dit(x[:, :, s:s + chunk], t0, text, camera[:, :, s:s + chunk], cache, commit=True)
                         for s in range(0, frames, chunk)], dim=2)
    check(f"rollout window={window} sink={sink}", got, want)
    assert cache.frames == frames
    kept = frames if window is None else window
    assert cache.tokens() == kept * 6
    if window is not None:  # the window really cuts: unmasked differs
        with torch.no_grad():
            assert (dit(x, t0, text, camera) - want).abs().max() > 1e-3


def test_denoising_forward_leaves_the_cache_alone():
    config = tiny(window_frames=4)
    dit = make_dit(config, seed=6)
    x, text, camera = inputs(4, torch.Generator().manual_seed(7), config)
    with torch.no_grad():
        cache = dit.new_cache()
        dit(x[:, :, :2], torch.tensor([0.0]), text, camera[:, :, :2], cache, commit=True)
        keys = [k.clone() for k in cache.keys]
        a = dit(x[:, :, 2:], torch.tensor([700.0]), text, camera[:, :, 2:], cache)
        b = dit(x[:, :, 2:], torch.tensor([700.0]), text, camera[:, :, 2:], cache)
    assert torch.equal(a, b) and cache.frames == 2
    assert all(torch.equal(k, c) for k, c in zip(keys, cache.keys))


def test_distilled_schedule():
    timesteps, sigmas = distilled_schedule(LingbotConfig())
    assert timesteps.tolist() == [999.0, 937.0, 833.0, 624.0]
    assert sigmas[0] == pytest.approx(0.999 * 5 / (1 + 4 * 0.999))
    assert all(a > b for a, b in zip(sigmas, sigmas[1:]))


def test_denoise_chunk_is_seeded_and_commits():
    config = tiny(window_frames=4)
    dit = make_dit(config, seed=8)
    gen = torch.Generator().manual_seed(9)
    text = torch.randn(1, 7, 16, generator=gen)
    cond = torch.randn(1, 8, 2, 4, 6, generator=gen)
    camera = torch.randn(1, config.camera_channels, 2, 4, 6, generator=gen)

    def run():
        rollout = Rollout(dit.new_cache(), text, torch.Generator().manual_seed(11))
        with torch.no_grad():
            out = [denoise_chunk(dit, rollout, cond, camera, (1, 4, 2, 4, 6)) for _ in range(3)]
        return rollout, out

    (r1, a), (_, b) = run(), run()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert r1.chunks == 3 and r1.cache.frames == 6 and r1.cache.tokens() == 4 * 6
    assert torch.isfinite(torch.stack(a)).all() and not torch.equal(a[0], a[1])
