"""Our Cosmos3 sound tokenizer (the AVAE) against diffusers 0.42.1 ``Cosmos3AVAEAudioTokenizer`` on
a tiny random config, loaded from the layout diffusers saves (``sound_tokenizer/``, weight-norm
``weight_g`` / ``weight_v`` pairs): the encoder's posterior (mean and std) and the decoded
waveform within 1e-5 relative, coverage both ways, decoder-only checkpoints, refused variants."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mstar.model.cosmos3.checkpoint import Cosmos3Checkpoint
from mstar.model.cosmos3.sound_tokenizer import SoundTokenizerConfig
from mstar.model.weights import WeightLoadError
from tests.support.cosmos3_sound import SOUND, reference_tokenizer, write_sound_tokenizer

pytest.importorskip("diffusers")

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def reference():
    return reference_tokenizer()


@pytest.fixture(scope="module")
def ours(reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("sound")
    write_sound_tokenizer(root, reference)
    return Cosmos3Checkpoint(root).load_sound_tokenizer(device=torch.device("cpu"), dtype=torch.float32,
                                                        dummy=False, seed=0, encoder=True)


def test_released_layout_has_weight_norm_pairs(reference):
    names = set(reference.state_dict())
    assert "decoder.conv1.weight_g" in names and "encoder.layers.0.weight_v" in names


def test_encode_matches_diffusers(reference, ours):
    gen = torch.Generator().manual_seed(0)
    audio = 0.5 * torch.randn(2, 2, 12 * 7 - 5, generator=gen)  # padded to the hop inside
    with torch.no_grad():
        want = reference.encode(audio).latent_dist
        mean, std = ours.moments(audio)
    assert mean.shape == want.mean.shape == (2, 4, 7)
    print(f"[parity] sound encode mean {rel(mean, want.mean):.1e} std {rel(std, want.std):.1e}")
    assert rel(mean, want.mean) <= 1e-5 and rel(std, want.std) <= 1e-5
    assert torch.equal(ours.encode(audio), mean)


def test_decode_matches_diffusers(reference, ours):
    latents = torch.randn(2, 4, 9, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference.decode(latents)
        got = ours.decode(latents)
    assert got.shape == want.shape == (2, 2, 9 * 12)
    inside = (want.abs() < 1).float().mean()
    print(f"[parity] sound decode {rel(got, want):.1e} ({inside:.0%} of samples inside the clamp)")
    assert inside > 0.5
    assert rel(got, want) <= 1e-5


def test_decoder_only_checkpoint(reference, tmp_path):
    write_sound_tokenizer(tmp_path, reference, drop="encoder.")
    ckpt = Cosmos3Checkpoint(tmp_path)
    kwargs = dict(device=torch.device("cpu"), dtype=torch.float32, dummy=False, seed=0)
    decoder = ckpt.load_sound_tokenizer(**kwargs)
    assert decoder.encoder is None
    latents = torch.randn(1, 4, 3, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(decoder.decode(latents), reference.decode(latents)) <= 1e-5
    with pytest.raises(ValueError, match="decoder-only"):
        decoder.encode(torch.zeros(1, 2, 12))
    with pytest.raises(WeightLoadError, match="encoder"):  # coverage: the encoder's parameters stay unfilled
        ckpt.load_sound_tokenizer(**kwargs, encoder=True)


def test_coverage_both_ways(reference, tmp_path):
    write_sound_tokenizer(tmp_path, reference)
    folder = tmp_path / "sound_tokenizer"
    from safetensors.torch import load_file

    state = load_file(folder / "diffusion_pytorch_model.safetensors")
    kwargs = dict(device=torch.device("cpu"), dtype=torch.float32, dummy=False, seed=0, encoder=True)
    missing = {k: v for k, v in state.items() if not k.startswith("decoder.snake1.")}
    save_file(missing, folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(WeightLoadError, match="decoder.snake1"):
        Cosmos3Checkpoint(tmp_path).load_sound_tokenizer(**kwargs)
    save_file({**state, "decoder.extra": torch.zeros(1)}, folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(WeightLoadError, match="decoder.extra"):
        Cosmos3Checkpoint(tmp_path).load_sound_tokenizer(**kwargs)
    save_file({k: v for k, v in state.items() if k != "decoder.conv1.weight_v"},
              folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(WeightLoadError, match="weight_g"):
        Cosmos3Checkpoint(tmp_path).load_sound_tokenizer(**kwargs)


@pytest.mark.parametrize("key, value", [("dec_type", "dac"), ("latent_mean", 0.0), ("causal", True),
                                        ("enc_latent_dim", 6), ("bogus", 1)])
def test_refused_variants_name_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        SoundTokenizerConfig.from_dict({**SOUND, key: value})


def test_hop_and_latent_frames():
    config = SoundTokenizerConfig.from_dict(SOUND)
    assert config.hop == 12 and config.latent_frames(25) == 3
    assert SoundTokenizerConfig().hop == 1920 and SoundTokenizerConfig().latent_frames(48000 * 5) == 125
