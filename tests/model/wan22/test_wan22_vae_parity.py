"""Parity of the Wan2.2 VAE against diffusers' ``AutoencoderKLWan`` (Wan2.2 layout: residual
blocks, patch size 2) on a tiny random config in float32 on the CPU: encode (chunked, the first
frame alone then four at a time) and decode (one latent frame at a time, the temporal
upsamplers' first-chunk rule), and the latent normalisation. A decode carried across pieces
(``DecodeState``) equals the decode of the whole."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import AutoencoderKLWan

from mstar.model.wan22.vae import DecodeState, WanVAE, WanVAEConfig

TOL = 1e-5
TINY = dict(base_dim=4, decoder_base_dim=6, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
            temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
            patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
            latents_mean=[0.1, -0.2, 0.3, 0.05], latents_std=[1.5, 0.7, 2.0, 1.1])


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


@pytest.fixture(scope="module")
def models():
    ref = AutoencoderKLWan(**TINY).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "gamma" in name else
                    0.1 * noise if p.ndim == 1 else noise * 1.2 / math.sqrt(p[0].numel()))
    ours = WanVAE(WanVAEConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def test_encode_parity(models):
    ours, ref = models
    video = torch.rand(2, 3, 9, 32, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        want = ref.encode(video).latent_dist.mode()
        got = ours.encode(video)
    check("encode", got, want)
    image = video[:, :, :1]  # image-to-video encodes the image alone
    with torch.no_grad():
        check("encode one frame", ours.encode(image), ref.encode(image).latent_dist.mode())


@pytest.mark.parametrize(("frames", "chunk"), [(1, 4), (3, 4), (6, 1), (6, 2), (6, 4)])
def test_decode_parity(models, frames, chunk):
    """The reference decodes one latent frame at a time; ours after the first ``chunk`` at a time
    (6 frames at 2 or 4: chunks of 2, 2, 1 and 4, 1)."""
    ours, ref = models
    latents = torch.randn(2, 4, frames, 2, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref.decode(latents).sample
        got = ours.decode(latents, chunk=chunk)
    assert got.shape == (2, 3, 1 + 4 * (frames - 1), 32, 64)
    check(f"decode {frames} latent frames, chunk {chunk}", got, want)


@pytest.mark.parametrize(("splits", "chunk"), [
    ((1, 6), 1), ((3, 4), 1), ((2, 1, 4), 1), ((1,) * 7, 1), ((4, 3), 2), ((2, 5), 4), ((5, 1, 1), 4)])
def test_a_decode_carried_across_pieces_is_the_whole(models, splits, chunk):
    """7 latent frames decoded piece by piece on one ``DecodeState``: the first piece gives
    ``1 + 4 (T - 1)`` frames, every later one ``4 T``, and the pieces joined are the decode of
    the whole (bit for bit at chunk 1, where both run the same convolutions on the same frames;
    within float rounding, a few 1e-6, where the pieces cut the chunks elsewhere) and so
    diffusers' decode of it."""
    ours, ref = models
    latents = torch.randn(1, 4, sum(splits), 2, 3, generator=torch.Generator().manual_seed(3))
    state = DecodeState()
    with torch.no_grad():
        whole = ours.decode(latents, chunk=chunk)
        pieces = [ours.decode(part, chunk=chunk, state=state) for part in latents.split(list(splits), dim=2)]
        want = ref.decode(latents).sample
    assert [p.shape[2] for p in pieces] == [1 + 4 * (splits[0] - 1), *(4 * t for t in splits[1:])]
    assert state.latent_frames == sum(splits) and state.nbytes > 0
    joined = torch.cat(pieces, dim=2)
    err = ((joined - whole).abs().max() / whole.abs().max()).item()
    print(f"[parity] carried decode {splits} chunk {chunk} vs whole: max rel err {err:.2e}")
    if chunk == 1:
        assert torch.equal(joined, whole)
    assert err <= 1e-5
    check(f"carried decode {splits} chunk {chunk}", joined, want)


def test_a_carried_state_copy_is_a_snapshot(models):
    """Decoding on from a copy leaves the original where it was: a piece decoded again from it
    gives the same frames (a window's decode run twice, as a worker retry does)."""
    ours, _ = models
    latents = torch.randn(1, 4, 5, 2, 3, generator=torch.Generator().manual_seed(4))
    state = DecodeState()
    with torch.no_grad():
        ours.decode(latents[:, :, :2], state=state)
        once = ours.decode(latents[:, :, 2:], state=state.copy())
        again = ours.decode(latents[:, :, 2:], state=state.copy())
        fresh = ours.decode(latents[:, :, 2:])  # no state: a clip of its own, not a continuation
    assert state.latent_frames == 2 and torch.equal(once, again)
    assert once.shape[2] == 12 and fresh.shape[2] == 9


def test_normalize_round_trip(models):
    ours, _ = models
    z = torch.randn(1, 4, 2, 2, 2)
    mean = torch.tensor(TINY["latents_mean"]).view(1, 4, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(TINY["latents_std"]).view(1, 4, 1, 1, 1)
    assert torch.equal(ours.normalize(z), (z - mean) * inv_std)
    assert torch.equal(ours.denormalize(z), z / inv_std + mean)


def test_wan22_checkpoint_refuses_wan21_layout(tmp_path):
    """The VAE module also builds Wan2.1's layout (LingBot-World's); the wan22 family refuses it."""
    import json

    from mstar.model.wan22.checkpoint import WanCheckpoint

    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({**TINY, "is_residual": False, "patch_size": None}))
    assert not WanVAEConfig.from_dict({**TINY, "is_residual": False, "patch_size": None}).residual
    with pytest.raises(ValueError, match="is_residual"):
        WanCheckpoint(tmp_path).vae_config()


@pytest.mark.parametrize("first_chunk", [True, False])
def test_reshaping_ops_keep_a_channels_last_activation(first_chunk):
    """With ``vae_channels_last`` cuDNN hands the decoder channels-last activations; the nearest
    upsampling, the temporal upsampler's frame interleave and the up blocks' shortcut give the same
    numbers on them as on contiguous ones, and keep them channels-last (no layout conversion
    before the next convolution). On the CPU the convolutions return contiguous tensors, so this
    runs the ops alone."""
    from mstar.layers.triton_channel_norm import channels_last
    from mstar.model.wan22.vae import double_space, dup_up, interleave_frames

    x = torch.randn(2, 8, 3, 5, 7)
    last = x.contiguous(memory_format=torch.channels_last_3d)
    for name, op in (("double_space", double_space), ("interleave_frames", interleave_frames),
                     ("dup_up", lambda v: dup_up(v, 4, 2, 2, first_chunk))):
        want, got = op(x), op(last)
        assert torch.equal(got, want), name
        assert got.stride(1) == 1 and want.stride(-1) == 1, name  # channels innermost, as they came
        assert channels_last(got) or (name == "dup_up" and first_chunk), name  # a frame cut off: not dense
    want = torch.nn.functional.interpolate(x.flatten(1, 2), scale_factor=2.0, mode="nearest-exact")
    assert torch.equal(double_space(x).flatten(1, 2), want)


def test_upsampler_convolution_on_the_frames_before_doubling():
    """Under ``fused_kernels`` an upsampler convolves the frames before they are doubled, with
    four 2x2 phase kernels: in float64 the same as the 3x3 kernel on the doubled frames (to
    rounding), borders included; a change of the weights makes new phase kernels."""
    from mstar.model.wan22.vae import Upsample, conv_frames, double_space

    torch.manual_seed(0)
    up = Upsample(6, temporal=False, out_dim=5).double()
    x = torch.randn(2, 6, 3, 4, 7, dtype=torch.float64)
    want = conv_frames(up.resample[1], double_space(x))
    up.fused = True
    assert (up(x, {}) - want).abs().max() < 1e-12
    with torch.no_grad():
        up.resample[1].weight.mul_(2.0)
    assert (up(x, {}) - conv_frames(up.resample[1], double_space(x))).abs().max() < 1e-12
