"""The fused AdaIN + activation + mask kernels against the torch reference and the vocoder's
eager modules, and a tiny Kokoro decoding with them against eager.

Without a GPU the kernels run on CPU tensors under Triton's interpreter: ``TRITON_INTERPRET``
is set here before ``mstar.layers.triton_adain`` is first imported. Skipped without Triton.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before triton's first import: its own jit'd helpers read it too
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from mstar.layers import triton_adain  # noqa: E402
from mstar.layers.triton_adain import adain_act, torch_adain_act  # noqa: E402
from mstar.model.kokoro import KokoroConfig, KokoroModel  # noqa: E402
from mstar.model.kokoro.blocks import AdainResBlk1d  # noqa: E402
from mstar.model.vocoder.istftnet import AdaIN1d, AdaINResBlock1, use_fused_kernels  # noqa: E402
from tests.support.kokoro import TINY_CONFIG  # noqa: E402
from tests.support.vocoder import peak_err  # noqa: E402

if DEVICE.type == "cpu" and not triton_adain.INTERPRET:
    pytest.skip("triton was imported before TRITON_INTERPRET was set", allow_module_level=True)


def case(rows: int = 3, channels: int = 5, frames: int = 2100, offset: float = 0.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels, frames, generator=g) * 2 + offset
    lengths = torch.tensor([frames, frames // 2 + 3, 37][:rows])
    keep = torch.arange(frames)[None] < lengths[:, None]
    params = dict(weight=torch.randn(channels, generator=g), bias=torch.randn(channels, generator=g),
                  gamma=torch.randn(rows, channels, generator=g), beta=torch.randn(rows, channels, generator=g),
                  alpha=torch.rand(channels, generator=g) + 0.3)
    return x.to(DEVICE), keep.to(DEVICE), {k: v.to(DEVICE) for k, v in params.items()}


@pytest.mark.parametrize("act", [None, "snake", "leaky_relu"])
@pytest.mark.parametrize("masked", [True, False], ids=["keep", "all"])
def test_kernels_match_the_torch_reference(act, masked):
    """Frames past a block boundary and rows of three lengths; a mean far from zero (the
    variance is taken around it, as the reference does)."""
    x, keep, p = case(offset=50.0)
    keep = keep if masked else None
    ours = adain_act(x, keep, eps=1e-5, act=act, slope=0.2, **p)
    ref = torch_adain_act(x, keep, eps=1e-5, act=act, slope=0.2, **p)
    assert (ours - ref).abs().max() < 1e-4
    if masked:
        assert not ours[2, :, 37:].any()  # zeros past the short row's end


def test_a_row_with_no_valid_frame_is_zeros():
    x, keep, p = case(rows=2, frames=300)
    keep[1] = False
    ours = adain_act(x, keep, eps=1e-5, act="snake", **p)
    assert not ours[1].any() and ours[0].isfinite().all()


def test_reference_equals_the_modules_eager_chain():
    """``AdaIN1d.activated`` eager (the vocoder's reference path) and with the kernels."""
    torch.manual_seed(0)
    norm = AdaIN1d(16, 5).to(DEVICE)
    with torch.no_grad():
        norm.norm.weight.normal_()
        norm.norm.bias.normal_()
    x, keep, p = case()
    s = torch.randn(3, 16, device=DEVICE)
    with torch.no_grad():
        for act, kwargs in (("snake", {"alpha": p["alpha"].reshape(1, -1, 1)}), ("leaky_relu", {"slope": 0.2})):
            for k in (keep, None):
                eager = norm.activated(x, s, k, act, **kwargs)
                gamma, beta = norm.fc(s).chunk(2, dim=1)
                ref = torch_adain_act(x, k, norm.norm.weight, norm.norm.bias, norm.norm.eps, gamma, beta, act,
                                      **kwargs)
                norm.fused = True
                fused = norm.activated(x, s, k, act, **kwargs)
                norm.fused = False
                assert (eager - ref).abs().max() < 1e-4
                assert (fused - eager).abs().max() < 1e-4


def test_bad_arguments_are_refused():
    x, keep, p = case(frames=64)
    with pytest.raises(ValueError, match="act must be"):
        adain_act(x, keep, eps=1e-5, act="gelu", **p)
    p.pop("alpha")
    with pytest.raises(ValueError, match="needs alpha"):
        adain_act(x, keep, eps=1e-5, act="snake", **p)


@pytest.mark.parametrize("upsample", [False, True])
def test_residual_blocks_with_the_kernels_equal_eager(upsample):
    """Kokoro's decoder block (leaky ReLU, with and without its upsampling) and the
    vocoder's Snake block, random weights, rows of three lengths: fused against eager."""
    torch.manual_seed(0)
    x, keep, _ = case(channels=8, frames=150)
    s = torch.randn(3, 16, device=DEVICE)
    blocks = [AdainResBlk1d(8, 8, 16, upsample=upsample)]
    if not upsample:
        blocks.append(AdaINResBlock1(8, 3, (1, 3, 5), 16))
    for block in blocks:
        block.to(DEVICE).eval()
        with torch.no_grad():
            for prm in block.parameters():
                prm.add_(0.1 * torch.randn_like(prm))
            eager = block(x, s, keep)
            use_fused_kernels(block, True)
            fused = block(x, s, keep)
        assert eager.shape == fused.shape
        assert (fused - eager).abs().max() < 1e-4 * eager.abs().max().clamp_min(1)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="minutes of audio-rate work under the interpreter")
def test_kokoro_audio_with_the_kernels_equals_eager(monkeypatch):
    """A tiny random Kokoro (noise on, each row's own seeded generator): two rows batched and
    one alone, the fused decoder's audio against the eager one's. TF32 convolutions off: on
    their own they move the audio by ~1e-3 of peak between two runs of the same maths."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = KokoroModel(KokoroConfig.from_dict(TINY_CONFIG)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            prm.add_((0.5 if "duration_proj" in name else 0.05) * torch.randn(prm.shape, generator=g))
        model.decoder.generator.conv_post.weight.mul_(0.05)
    model.to(DEVICE)
    ids = torch.tensor([[0, 5, 9, 3, 7, 0], [0, 4, 8, 0, 0, 0]], device=DEVICE)
    lengths = torch.tensor([6, 4], device=DEVICE)
    voices = torch.randn(2, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 0.5
    runs = {}
    for fused in (False, True):
        use_fused_kernels(model, fused)
        gens = [torch.Generator(DEVICE).manual_seed(s) for s in (11, 12)]
        batched, _ = model(ids, voices, 1.0, lengths, generators=gens)
        solo, _ = model(ids[1:, :4], voices[1:], 1.0, generators=[torch.Generator(DEVICE).manual_seed(12)])
        runs[fused] = batched + solo
    use_fused_kernels(model, False)
    for eager, fused in zip(runs[False], runs[True], strict=True):
        assert eager.shape == fused.shape
        assert peak_err(fused, eager) < 1e-4
