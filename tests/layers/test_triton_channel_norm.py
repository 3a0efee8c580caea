"""The fused channel RMS norm + SiLU kernel against its torch reference and the Wan2.2 VAE's
eager norm, and a tiny VAE decode with the kernel against eager.

Without a GPU the kernel runs on CPU tensors under Triton's interpreter (see
tests/support/triton_interpreter.py); when Triton was imported first in this session the kernel
tests skip here and ``test_kernels_in_a_fresh_interpreter`` runs the file again in a process of
its own.
"""

from __future__ import annotations

import pytest
import torch

from mstar.layers import triton_channel_norm  # noqa: E402
from mstar.layers.triton_channel_norm import channel_norm, torch_channel_norm  # noqa: E402
from mstar.model.wan22.vae import (  # noqa: E402
    RMSNorm,
    WanVAE,
    WanVAEConfig,
    use_channels_last,
    use_fused_kernels,
)
from tests.support.triton_interpreter import DEVICE, REASON, kernels_runnable, rerun_in_fresh_interpreter

RUNNABLE = kernels_runnable(triton_channel_norm)
runnable = pytest.mark.skipif(not RUNNABLE, reason=REASON)

TINY_VAE = dict(base_dim=4, decoder_base_dim=6, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16, latents_mean=[0.0] * 4,
                latents_std=[1.0] * 4)


@runnable
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("shape", [(2, 37, 3, 5, 19), (1, 8, 130), (3, 64, 2, 4)], ids=["5d", "3d", "4d"])
def test_kernel_matches_the_torch_reference(shape, silu):
    """Channel counts past one tile (37, 64) and not a multiple of it; pixel counts past one
    block (285, 130) and under it; one pixel of all zeros (the norm's floor)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE)
    x[0, :, 0] = 0.0
    weight = torch.randn(shape[1], generator=g).to(DEVICE)
    got, want = channel_norm(x, weight, silu), torch_channel_norm(x, weight, silu)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert (got - want).abs().max() < 1e-5
    assert not got[0, :, 0].any()


@runnable
@pytest.mark.parametrize("shape", [(2, 37, 3, 5, 19), (3, 64, 2, 4)], ids=["5d", "4d"])
def test_channels_last_is_read_in_place_and_kept(shape):
    """A channels-last activation (cuDNN's layout) is normalised as it lies: the same numbers as
    the contiguous one, and the output channels-last too, so no layout conversion is added."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(DEVICE)
    weight = torch.randn(shape[1], generator=g).to(DEVICE)
    layout = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
    last = x.contiguous(memory_format=layout)
    got = channel_norm(last, weight, True)
    assert triton_channel_norm.channels_last(last) and not triton_channel_norm.channels_last(x)
    assert got.is_contiguous(memory_format=layout) and not got.is_contiguous()
    assert (got - torch_channel_norm(x, weight, True)).abs().max() < 1e-5
    strided = x.transpose(2, 3)  # neither layout: read through a contiguous copy
    assert (channel_norm(strided, weight, False) - torch_channel_norm(strided, weight, False)).abs().max() < 1e-5


@runnable
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d],
                         ids=["contiguous", "channels_last"])
def test_writes_into_a_slice_of_frames(layout):
    """``out`` a slice along the frames of a larger buffer (a causal convolution's input with its
    past frames in front): the norm lands there, the frames in front stay as they were."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 40, 3, 5, 9, generator=g).to(DEVICE).contiguous(memory_format=layout)
    weight = torch.randn(40, generator=g).to(DEVICE)
    buffer = torch.full((2, 40, 5, 5, 9), 7.0, device=DEVICE).contiguous(memory_format=layout)
    got = channel_norm(x, weight, True, out=buffer[:, :, 2:])
    assert got.data_ptr() == buffer[:, :, 2:].data_ptr()
    assert (buffer[:, :, 2:] - torch_channel_norm(x, weight, True)).abs().max() < 1e-5
    assert (buffer[:, :, :2] == 7.0).all()
    with pytest.raises(ValueError, match="cannot hold"):
        channel_norm(x, weight, True, out=buffer[:, :, :, 1:])  # rows cut short: pixels not at one stride


@runnable
def test_bfloat16_keeps_its_dtype():
    x = torch.randn(2, 40, 70).to(DEVICE, torch.bfloat16)
    weight = torch.rand(40).to(DEVICE)
    got = channel_norm(x, weight, True)
    assert got.dtype == torch.bfloat16
    assert (got.float() - torch_channel_norm(x, weight, True).float()).abs().max() < 2e-2


@runnable
@pytest.mark.parametrize("images", [False, True])
def test_vae_norm_fused_equals_eager(images):
    norm = RMSNorm(24, images=images).to(DEVICE)
    with torch.no_grad():
        norm.gamma.copy_(torch.rand_like(norm.gamma) + 0.5)
    x = torch.randn(2, 24, 3, 9, 7, device=DEVICE)
    x = x[:, :, 0] if images else x
    with torch.no_grad():
        eager = norm(x, silu=not images)
        norm.fused = True
        fused = norm(x, silu=not images)
    assert (fused - eager).abs().max() < 1e-5


@runnable
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_vae_decode_fused_equals_eager(monkeypatch, channels_last):
    """With ``channels_last`` the fused decode runs on channels-last weights, and every 3D
    convolution returns channels-last activations as cuDNN does on CUDA (the CPU's return
    contiguous ones, so off CUDA the test makes them so): every op after a convolution then
    meets that layout."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # TF32 convolutions would swamp 1e-4
    if channels_last and DEVICE.type != "cuda":
        conv3d = torch.nn.functional.conv3d

        def as_cudnn(x, weight, *args, **kwargs):
            out = conv3d(x, weight, *args, **kwargs)
            on = triton_channel_norm.channels_last(x) or triton_channel_norm.channels_last(weight)
            return out.contiguous(memory_format=torch.channels_last_3d) if on else out

        monkeypatch.setattr(torch.nn.functional, "conv3d", as_cudnn)
    torch.manual_seed(0)
    vae = WanVAE(WanVAEConfig.from_dict(TINY_VAE)).to(DEVICE).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "gamma" in name:
                p.copy_(torch.rand_like(p) + 0.5)
        latents = torch.randn(1, 4, 2, 2, 3, device=DEVICE)
        eager = vae.decode(latents)
        use_fused_kernels(vae)
        use_channels_last(vae, channels_last)
        fused = vae.decode(latents)
    assert (fused - eager).abs().max() < 1e-4


def test_kernels_in_a_fresh_interpreter():
    if RUNNABLE or DEVICE.type == "cuda":
        pytest.skip("the kernels ran in this process")
    rerun_in_fresh_interpreter(__file__)
