"""Parity of the SNAC decoder (codes -> audio) against the reference ``snac`` package.

Random (seeded) weights, fp32 on CPU. Most checks use the 24 kHz layout (rates, strides,
depthwise, noise) with small channel counts; one check runs the real 24 kHz config.
"""

from __future__ import annotations

import copy

import pytest
import torch
from snac import SNAC
from snac.layers import DecoderBlock as RefDecoderBlock
from snac.layers import NoiseBlock as RefNoiseBlock

from mstar.model.snac import (
    SnacConfig,
    SnacDecoder,
    codes_from_orpheus,
    load_snac_state_dict,
)
from mstar.model.snac.modeling import DecoderBlock
from mstar.model.weights import WeightLoadError

TOL = 1e-5
SNAC_24KHZ = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}
SMALL = SnacConfig(encoder_dim=8, decoder_dim=32, codebook_size=64)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = rel_err(ours, ref)
    print(f"[snac parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


def build_pair(config: SnacConfig, seed: int = 0) -> tuple[SNAC, SnacDecoder]:
    torch.manual_seed(seed)
    ref = SNAC(**config.to_dict()).eval()
    with torch.no_grad():  # perturb the init so that no parameter keeps a trivial value
        for p in ref.parameters():
            p.mul_(1 + 0.1 * torch.randn_like(p))
    ours = SnacDecoder(config).eval()
    skipped = load_snac_state_dict(ours, ref.state_dict())
    assert skipped and all(k.startswith("encoder.") or ".in_proj." in k for k in skipped)
    return ref, ours


def random_codes(
    config: SnacConfig, frames: int, batch: int = 2, seed: int = 1
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    steps = frames * config.vq_strides[0]
    return [
        torch.randint(0, config.codebook_size, (batch, steps // s), generator=g)
        for s in config.vq_strides
    ]


def window(
    codes: list[torch.Tensor], config: SnacConfig, start: int, frames: int
) -> list[torch.Tensor]:
    """Frames ``[start, start + frames)`` of every level."""
    per_frame = [config.vq_strides[0] // s for s in config.vq_strides]
    return [c[:, start * n : (start + frames) * n] for c, n in zip(codes, per_frame)]


@pytest.fixture(scope="module")
def small() -> tuple[SNAC, SnacDecoder]:
    return build_pair(SMALL)


def test_config() -> None:
    cfg = SnacConfig.from_dict(SNAC_24KHZ)
    assert cfg == SnacConfig()
    assert cfg.resolved_latent_dim == 768 and cfg.hop_length == 512
    assert cfg.samples_per_frame == 2048
    assert SnacConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        SnacConfig.from_dict({**SNAC_24KHZ, "bogus": 1})


def test_real_config_names_and_shapes() -> None:
    torch.manual_seed(0)  # CPU build: faster than on the meta device for this model
    ref = SNAC(**SNAC_24KHZ)
    ours = SnacDecoder(SnacConfig.from_dict(SNAC_24KHZ))
    ref_sd = {
        k: v.shape
        for k, v in ref.state_dict().items()
        if not (k.startswith("encoder.") or ".in_proj." in k)
    }
    ours_sd = {k: v.shape for k, v in ours.state_dict().items()}
    assert ours_sd == ref_sd
    assert any("parametrizations.weight.original0" in k for k in ours_sd)


def test_quantizer_latent(small: tuple[SNAC, SnacDecoder]) -> None:
    ref, ours = small
    codes = random_codes(SMALL, frames=5)
    with torch.no_grad():
        check("latent", ours.codes_to_latent(codes), ref.quantizer.from_codes(codes))


def test_decoder_block(small: tuple[SNAC, SnacDecoder]) -> None:
    ref, ours = small
    idx = next(i for i, m in enumerate(ref.decoder.model) if isinstance(m, RefDecoderBlock))
    ref_block, our_block = ref.decoder.model[idx], ours.decoder.model[idx]
    assert isinstance(our_block, DecoderBlock)
    x = torch.randn(2, SMALL.decoder_dim, 12)
    with torch.no_grad():
        torch.manual_seed(7)
        expected = ref_block(x)
        torch.manual_seed(7)
        check("decoder block (global seed)", our_block(x), expected)
        gen = torch.Generator().manual_seed(7)
        check("decoder block (generator)", our_block(x, True, gen), expected)


def test_decode_same_seed(small: tuple[SNAC, SnacDecoder]) -> None:
    ref, ours = small
    codes = random_codes(SMALL, frames=6)
    with torch.no_grad():
        torch.manual_seed(123)
        expected = ref.decode(codes)
        torch.manual_seed(123)
        got = ours.decode(codes)
        gen = ours.decode(codes, generator=torch.Generator().manual_seed(123))
        other = ours.decode(codes, generator=torch.Generator().manual_seed(124))
    assert got.shape == (2, 1, 6 * SMALL.samples_per_frame)
    check("decode (global seed)", got, expected)
    check("decode (generator)", gen, expected)
    assert rel_err(other, expected) > 1e-3  # the noise is really used


def test_decode_noise_zeroed(small: tuple[SNAC, SnacDecoder]) -> None:
    ref, ours = small
    silent = copy.deepcopy(ref)
    noise_blocks = [m for m in silent.modules() if isinstance(m, RefNoiseBlock)]
    assert len(noise_blocks) == len(SMALL.decoder_rates)
    with torch.no_grad():
        for m in noise_blocks:
            m.linear.parametrizations.weight.original0.zero_()
        codes = random_codes(SMALL, frames=6)
        got = ours.decode(codes, noise=False)
        check("decode (noise off vs zeroed noise)", got, silent.decode(codes))


def test_decode_with_local_attention() -> None:
    cfg = SnacConfig(encoder_dim=8, decoder_dim=128, codebook_size=64, attn_window_size=4)
    ref, ours = build_pair(cfg, seed=3)
    codes = random_codes(cfg, frames=2)  # 8 latent steps: 2 attention windows
    with torch.no_grad():
        torch.manual_seed(5)
        expected = ref.decode(codes)
        torch.manual_seed(5)
        check("decode (local attention)", ours.decode(codes), expected)


def test_decode_real_config() -> None:
    cfg = SnacConfig()
    ref, ours = build_pair(cfg, seed=4)
    codes = random_codes(cfg, frames=1, batch=1)  # 2048 samples: keeps the test fast
    with torch.no_grad():
        torch.manual_seed(9)
        expected = ref.decode(codes)
        torch.manual_seed(9)
        check("decode (real 24 kHz config)", ours.decode(codes), expected)


def test_fuse_weight_norm(small: tuple[SNAC, SnacDecoder]) -> None:
    _, ours = small
    fused = SnacDecoder(SMALL).eval()  # not a deepcopy: parametrized classes would be shared
    fused.load_state_dict(ours.state_dict())
    fused.fuse_weight_norm()
    assert not any("parametrizations" in k for k in fused.state_dict())
    codes = random_codes(SMALL, frames=2)
    with torch.no_grad():
        got = fused.decode(codes, noise=False)
        check("fused weight norm", got, ours.decode(codes, noise=False))


def test_loader_coverage(small: tuple[SNAC, SnacDecoder]) -> None:
    ref, _ = small
    sd = ref.state_dict()
    target = SnacDecoder(SMALL)

    missing = {k: v for k, v in sd.items() if k != "decoder.model.2.block.0.alpha"}
    with pytest.raises(WeightLoadError, match=r"decoder\.model\.2\.block\.0\.alpha"):
        load_snac_state_dict(target, missing)
    with pytest.raises(WeightLoadError, match="quantizer.extra"):
        load_snac_state_dict(target, {**sd, "quantizer.extra": torch.zeros(1)})
    bad = dict(sd)
    bad["quantizer.quantizers.0.codebook.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightLoadError, match="shape"):
        load_snac_state_dict(target, bad)

    # legacy weight_g / weight_v names (old torch.nn.utils.weight_norm) are accepted
    legacy = {
        k.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        ): v
        for k, v in sd.items()
    }
    load_snac_state_dict(target, legacy)
    codes = random_codes(SMALL, frames=2)
    with torch.no_grad():
        check("legacy keys", target.decode(codes, noise=False), small[1].decode(codes, noise=False))


def test_codes_from_orpheus() -> None:
    frames = 3
    tokens = [100 * f + p for f in range(frames) for p in range(7)]
    c0, c1, c2 = codes_from_orpheus(tokens)
    assert c0.tolist() == [[0, 100, 200]]
    assert c1.tolist() == [[1, 4, 101, 104, 201, 204]]
    assert c2.tolist() == [[2, 3, 5, 6, 102, 103, 105, 106, 202, 203, 205, 206]]
    assert all(c.dtype == torch.int64 for c in (c0, c1, c2))
    with pytest.raises(ValueError, match="multiple of 7"):
        codes_from_orpheus(tokens[:-1])
    with pytest.raises(ValueError, match="lie in"):
        codes_from_orpheus([4096] * 7)
    ours = SnacDecoder(SMALL)
    small_tokens = [t % SMALL.codebook_size for t in tokens]
    with torch.no_grad():
        audio = ours.decode(codes_from_orpheus(small_tokens, codebook_size=64), noise=False)
    assert audio.shape == (1, 1, frames * 2048)


def test_sliding_window(small: tuple[SNAC, SnacDecoder]) -> None:
    """Windowed decoding (noise off, so windows and the whole sequence see the same noise).

    The decoder's receptive field is about +-10.2 latent steps (2.6 frames), measured by
    perturbing one latent step. A window with 3 frames of context on each side therefore
    reproduces the whole-sequence decode to fp32 precision. Orpheus's streaming window (4
    frames, keep samples [2048:4096], i.e. 1 frame of left and 2 of right context) cuts the
    receptive field, so it only approximates it: with these random weights the max error is
    8e-3 of the peak (about 3e-2 on a real-size random model); we allow 5e-2 of the peak.
    """
    _, ours = small
    spf, frames = SMALL.samples_per_frame, 8
    codes = random_codes(SMALL, frames=frames, seed=11)

    def windowed(size: int, keep: int) -> list[float]:
        """Decode every ``size``-frame window in one batch; per window, the error of its frame
        ``keep`` against the whole-sequence decode, relative to the whole decode's peak."""
        starts = range(frames - size + 1)
        windows = [window(codes, SMALL, s, size) for s in starts]
        batch = [torch.cat(level) for level in zip(*windows)]
        out = ours.decode(batch, noise=False).split(codes[0].shape[0])
        peak = full.abs().max()
        errs = []
        for s, o in zip(starts, out):
            kept = o[..., keep * spf : (keep + 1) * spf]
            target = full[..., (s + keep) * spf : (s + keep + 1) * spf]
            errs.append(((kept - target).abs().max() / peak).item())
        return errs

    with torch.no_grad():
        full = ours.decode(codes, noise=False)
        exact = windowed(7, keep=3)  # 3 frames of context on each side
        orpheus = windowed(4, keep=1)  # Orpheus: 4-frame windows, keep samples [2048:4096]
    print(f"[snac window] 3-frame context max err / peak {max(exact):.2e}")
    print(f"[snac window] Orpheus 4-frame window max err / peak {max(orpheus):.2e}")
    assert max(exact) <= TOL
    assert max(orpheus) <= 5e-2
