"""Parity of the FastConformer encoder and its log-mel front end against transformers'
``ParakeetEncoder``, ``NemotronAsrStreamingEncoder`` and their feature extractors: per block
and whole, on batches of clips of different lengths, float32 on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import ParakeetEncoder, ParakeetEncoderConfig, ParakeetFeatureExtractor
from transformers.models.nemotron_asr_streaming import (
    NemotronAsrStreamingEncoder,
    NemotronAsrStreamingEncoderConfig,
    NemotronAsrStreamingFeatureExtractor,
)

from mstar.model.fastconformer.config import FastConformerConfig
from mstar.model.fastconformer.encoder import FastConformerEncoder, attention_mask, lengths_mask, relative_positions
from mstar.model.fastconformer.features import MelSettings, log_mel
from mstar.model.weights import load_weights

TOL = 1e-5
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            subsampling_conv_channels=8, num_mel_bins=16, conv_kernel_size=5, dropout=0.0, layerdrop=0.0,
            activation_dropout=0.0, attention_dropout=0.0, dropout_positions=0.0)
MEL_FRAMES = (113, 80, 41)  # one batch of clips of different lengths


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    assert torch.isfinite(ref).all(), f"{name}: the reference is not finite"
    err = rel_err(ours, ref)
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (biases, norms and batch-norm statistics too), so no term
    of the maths hides behind a zero or a one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if tensor.is_floating_point():
                values = torch.randn(tensor.shape, generator=gen) * 0.2
                if name.endswith("running_var") or "norm" in name and name.endswith("weight"):
                    values = 1.0 + values.abs()
                tensor.copy_(values)


def pair(kind: str, **extra) -> tuple[torch.nn.Module, FastConformerEncoder]:
    """A random reference encoder of ``kind`` and ours with its weights."""
    torch.manual_seed(0)
    if kind == "parakeet":
        hf_config = ParakeetEncoderConfig(**TINY, **extra)
        ref = ParakeetEncoder(hf_config)
    else:
        hf_config = NemotronAsrStreamingEncoderConfig(**TINY, **extra)
        ref = NemotronAsrStreamingEncoder(hf_config)
    ref.eval()
    _randomise(ref, seed=1)
    ours = FastConformerEncoder(FastConformerConfig.from_hf_dict(hf_config.to_dict())).eval()
    load_weights(ours, ref.state_dict().items())
    return ref, ours


def batch(frames=MEL_FRAMES, mels: int = 16, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mel = torch.zeros(len(frames), max(frames), mels)
    mask = torch.zeros(len(frames), max(frames), dtype=torch.long)
    for i, n in enumerate(frames):
        mel[i, :n] = torch.randn(n, mels, generator=gen)
        mask[i, :n] = 1
    return mel, mask


@pytest.mark.parametrize("kind", ["parakeet", "nemotron"])
def test_block_parity(kind: str) -> None:
    ref, ours = pair(kind, **({"scale_input": False} if kind == "parakeet" else {}))
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([17, 11])
    x = torch.randn(2, 17, 32, generator=gen)
    valid = lengths_mask(lengths, 17)
    if kind == "parakeet":
        allowed = attention_mask(valid, None, None)
        ref_mask = (valid[:, None, :] & valid[:, :, None])[:, None]
        pos = relative_positions(17, 32, x.device, x.dtype)
        ref_pos = ref.encode_positions(x)
        check("relative positions", pos, ref_pos[0])
        with torch.no_grad():
            want = ref.layers[0](x, attention_mask=ref_mask, position_embeddings=ref_pos)
    else:
        allowed = attention_mask(valid, 70, 2)  # chunks of 3 frames
        ref_mask = allowed.expand(2, 1, 17, 17)
        pos = relative_positions(17, 32, x.device, x.dtype)
        with torch.no_grad():
            want = ref.layers[0](x, attention_mask=ref_mask, position_embeddings=ref.encode_positions(x))
    with torch.no_grad():
        got = ours.layers[0](x, pos, allowed, valid)
    for row, n in enumerate(lengths.tolist()):
        check(f"{kind} block row {row}", got[row, :n], want[row, :n])


@pytest.mark.parametrize("kind,lookahead", [("parakeet", None), ("nemotron", 13), ("nemotron", 1)])
def test_encoder_parity_batched(kind: str, lookahead: int | None) -> None:
    ref, ours = pair(kind)
    mel, mask = batch()
    with torch.no_grad():
        if kind == "parakeet":
            out = ref(mel, attention_mask=mask)
        else:
            out = ref(mel, attention_mask=mask, num_lookahead_tokens=lookahead)
        got, lengths = ours(mel, mask.sum(-1), lookahead=lookahead)
    assert lengths.tolist() == out.attention_mask.sum(-1).tolist()
    for row, n in enumerate(lengths.tolist()):
        check(f"{kind} encoder row {row}", got[row, :n], out.last_hidden_state[row, :n])
    # each clip alone encodes the same as in the batch
    for row, frames in enumerate(MEL_FRAMES):
        with torch.no_grad():
            solo, solo_len = ours(mel[row:row + 1, :frames], lookahead=lookahead)
        assert solo_len.item() == lengths[row].item()
        check(f"{kind} solo row {row}", solo[0], got[row, :solo_len.item()])


def test_streaming_encoder_left_context_limits_attention() -> None:
    """A left context shorter than the clip: each chunk sees only its window."""
    ref, ours = pair("nemotron", sliding_window=7)
    mel, mask = batch(frames=(200,))
    with torch.no_grad():
        want = ref(mel, attention_mask=mask, num_lookahead_tokens=2).last_hidden_state
        got, _ = ours(mel, lookahead=2)
    check("nemotron encoder, 6 frames of left context", got, want)


def _audio(lengths, seed=4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * 0.1 for n in lengths]


def test_log_mel_matches_parakeet_extractor() -> None:
    clips = _audio((16000, 9123, 4000))
    extractor = ParakeetFeatureExtractor(feature_size=80)
    ref = extractor([c.numpy() for c in clips], sampling_rate=16000, return_tensors="pt")
    settings = MelSettings.from_preprocessor(extractor.to_dict(), normalize=True)
    for i, clip in enumerate(clips):
        ours = log_mel(clip, settings)
        n = int(ref["attention_mask"][i].sum())
        assert ours.shape == (n, 80)
        check(f"parakeet log-mel {i}", ours, ref["input_features"][i, :n])


def test_log_mel_matches_nemotron_extractor() -> None:
    clips = _audio((12000, 7001))
    extractor = NemotronAsrStreamingFeatureExtractor(feature_size=128, mel_filters_dtype="bfloat16")
    ref = extractor([c.numpy() for c in clips], sampling_rate=16000, return_tensors="pt")
    settings = MelSettings.from_preprocessor(extractor.to_dict(), normalize=False)
    assert settings.filter_dtype == "bfloat16"
    for i, clip in enumerate(clips):
        ours = log_mel(clip, settings)
        n = int(ref["attention_mask"][i].sum())
        check(f"nemotron log-mel {i}", ours, ref["input_features"][i, :n])
