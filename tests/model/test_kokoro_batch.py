"""Kokoro's frame half batched across rows (``KokoroModel.frame_halves``): rows of very
different frame lengths padded to one length give each row its solo audio, fp32, CPU, on a
tiny random config (no reference needed: the solo path is pinned to kokoro==0.9.4 in
``test_kokoro_parity.py``).

Conditioning: the rows run with the harmonic source's noise on (each row's own generator, as
served). Without it an unvoiced row's source is a constant, whose STFT phase is the angle of
near-zero bins: rounding noise that the decoder amplifies (there, fp32 solo and fp64 solo
differ by the audio's whole peak), so no batched path could match it. ``conv_post`` is scaled
down so the random model's ``exp`` magnitudes stay in range, as a trained model's do.
"""

from __future__ import annotations

import pytest
import torch

from mstar.model.kokoro import KokoroConfig, KokoroModel
from mstar.model.vocoder import ISTFT, masked_instance_norm
from tests.support.kokoro import TINY_CONFIG
from tests.support.vocoder import peak_err

ROW_TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> KokoroModel:
    torch.manual_seed(0)
    m = KokoroModel(KokoroConfig.from_dict(TINY_CONFIG)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_((0.5 if "duration_proj" in name else 0.05) * torch.randn(p.shape, generator=g))
        m.decoder.generator.conv_post.weight.mul_(0.05)
    return m


def ids_of(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    inner = torch.randint(1, TINY_CONFIG["n_token"] - 1, (n,), generator=g)
    return torch.cat([torch.zeros(1, dtype=torch.long), inner, torch.zeros(1, dtype=torch.long)])


def voices_of(b: int, seed: int = 5) -> torch.Tensor:
    return torch.randn(b, 256, generator=torch.Generator().manual_seed(seed)) * 0.5


def seeded(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("bucket", [1, 16])
def test_padded_rows_equal_solo(model, bucket: int):
    """Rows of 2, 16 and 7 phonemes (frame counts several-fold apart), with and without
    bucketing the padded length: each row's audio is its solo audio."""
    rows = [ids_of(n, n) for n in (2, 16, 7)]
    voices, speeds = voices_of(3), torch.tensor([1.0, 0.8, 1.3])
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    with torch.no_grad():
        half = model.text_half(ids, torch.tensor([len(r) for r in rows]), voices, speeds)
        frames = half.durations.sum(dim=1).tolist()
        assert max(frames) >= 3 * min(frames)  # very different lengths: most of row 0 is padding
        batched = model.frame_halves(half, voices, generators=seeded([7, 8, 9]), bucket=bucket)
        for i in range(3):
            solo = model.frame_half(half, i, voices[i], generator=torch.Generator().manual_seed(7 + i))
            err = peak_err(batched[i], solo)
            print(f"[kokoro batch] row {i} ({frames[i]} frames, bucket {bucket}): {err:.2e} of peak")
            assert err <= ROW_TOL


def test_forward_batch_independent_of_partners(model):
    """``forward`` of a row with a seed gives the same audio alone and beside other rows, and
    a different seed gives different audio (the noise is per row, not shared)."""
    target = ids_of(6, 3)
    others = [ids_of(n, n + 40) for n in (12, 2)]
    voices = voices_of(3, seed=6)
    ids = torch.nn.utils.rnn.pad_sequence([target, *others], batch_first=True)
    lengths = torch.tensor([len(target), *(len(o) for o in others)])
    (alone,), _ = model(target[None], voices[:1], 1.0, generators=seeded([11]))
    together, _ = model(ids, voices, 1.0, lengths, generators=seeded([11, 12, 13]))
    assert peak_err(together[0], alone) <= ROW_TOL
    (reseeded,), _ = model(target[None], voices[:1], 1.0, generators=seeded([99]))
    assert peak_err(reseeded, alone) > 1e-3


def test_masked_instance_norm_ignores_padding():
    """Statistics over each row's valid frames: a padded row normalises as its unpadded self,
    whatever the padding holds (inf included)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 12, generator=g) * 3 + 1
    weight, bias = torch.randn(4, generator=g), torch.randn(4, generator=g)
    keep = torch.arange(12)[None] < torch.tensor([[7], [12]])
    x[0, :, 7:] = float("inf")
    got = masked_instance_norm(x, keep, weight, bias, 1e-5)
    want = torch.nn.functional.instance_norm(x[:1, :, :7], weight=weight, bias=bias, eps=1e-5)
    assert peak_err(got[0, :, :7], want[0]) <= 1e-6
    want = torch.nn.functional.instance_norm(x[1:], weight=weight, bias=bias, eps=1e-5)
    assert peak_err(got[1], want[0]) <= 1e-6


def test_stft_rows_equal_solo():
    """The source's STFT reflects each row at its own end, and the iSTFT divides each row by
    its own window envelope: padded rows equal their solo transforms."""
    stft = ISTFT(20, 5)
    g = torch.Generator().manual_seed(4)
    lengths = [60, 200, 135]
    signal = torch.randn(3, 210, generator=g)
    magnitude, phase = stft.analyse_rows(signal, torch.tensor(lengths))
    frames = torch.tensor([n // 5 + 1 for n in lengths])
    keep = torch.arange(magnitude.shape[-1])[None] < frames[:, None]
    wave = stft.synthesise_rows(magnitude + 0.1, phase, keep)
    for i, n in enumerate(lengths):
        want_m, want_p = stft.analyse(signal[i : i + 1, :n])
        k = want_m.shape[-1]
        assert peak_err(magnitude[i, :, :k], want_m[0]) <= 1e-6
        assert magnitude[i, :, k:].abs().max() == 0
        want = stft.synthesise(want_m + 0.1, want_p)
        assert peak_err(wave[i, 0, :n], want[0, 0]) <= 1e-5
