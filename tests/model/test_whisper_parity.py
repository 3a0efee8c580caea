"""Parity of the Whisper port (features, encoder, paged decoder) against Hugging Face."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from transformers import WhisperConfig as HFWhisperConfig
from transformers import WhisperFeatureExtractor
from transformers import WhisperForConditionalGeneration as HFWhisper
from transformers.audio_utils import mel_filter_bank
from transformers.modeling_outputs import BaseModelOutput

from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.model.whisper import (
    WhisperConfig,
    WhisperForConditionalGeneration,
    log_mel_spectrogram,
    mel_filterbank,
    mel_frames,
)
from mstar.model.whisper.cross_kv import CrossAttentionBatch, CrossKVSlots

TOL = 1e-5
SR = 16000
PAGE_SIZE = 4
NUM_PAGES = 32
SOT, LANG, TASK, NO_TIMESTAMPS = 90, 91, 92, 93
TINY: dict[str, Any] = dict(
    vocab_size=100,
    num_mel_bins=80,
    d_model=64,
    encoder_layers=2,
    encoder_attention_heads=4,
    decoder_layers=2,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_source_positions=1500,  # the mel is always 3000 frames
    max_target_positions=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=SOT,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = rel_err(ours, ref)
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


def make_audio(kind: str, seconds: float, seed: int) -> np.ndarray:
    """Random noise, a tone, or a chirp plus noise, float32 in about [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    if kind == "noise":
        x = 0.1 * rng.standard_normal(t.shape)
    elif kind == "sine":
        x = 0.5 * np.sin(2 * np.pi * 440.0 * t)
    else:
        x = 0.4 * np.sin(2 * np.pi * (200.0 + 150.0 * t) * t) + 0.02 * rng.standard_normal(t.shape)
    return x.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Config and log-mel features
# ---------------------------------------------------------------------------------------------


def test_config_round_trips_through_hf() -> None:
    ours = WhisperConfig(**TINY, suppress_tokens=[5, 6], begin_suppress_tokens=[2])
    hf = HFWhisperConfig(**ours.to_hf_dict())
    assert WhisperConfig.from_hf_dict(hf.to_dict()) == ours
    default = WhisperConfig.from_hf_dict(HFWhisperConfig().to_dict())  # whisper-tiny defaults
    assert (default.d_model, default.decoder_layers, default.vocab_size) == (384, 4, 51865)
    assert default.begin_suppress_tokens == [220, 50256]


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filterbank_matches_hf(n_mels: int) -> None:
    ref = mel_filter_bank(
        num_frequency_bins=201,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=SR,
        norm="slaney",
        mel_scale="slaney",
    )
    check(f"mel filters[{n_mels}]", mel_filterbank(n_mels).T, torch.from_numpy(ref), tol=1e-12)


AUDIO_CASES = [
    ("noise", 0.4, 80),  # short: mostly padding
    ("sine", 3.0, 80),
    ("chirp", 30.0, 80),  # exactly 30 s
    ("noise", 34.5, 80),  # longer than 30 s: trimmed
    ("chirp", 7.3, 128),  # large-v3 style 128 mel bins
]


@pytest.mark.parametrize("kind,seconds,n_mels", AUDIO_CASES)
def test_log_mel_matches_feature_extractor(kind: str, seconds: float, n_mels: int) -> None:
    audio = make_audio(kind, seconds, seed=int(seconds * 10))
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    out = extractor(audio, sampling_rate=SR, return_tensors="np", return_attention_mask=True)
    padded = np.zeros(extractor.n_samples, np.float32)
    padded[: min(len(audio), extractor.n_samples)] = audio[: extractor.n_samples]
    numpy_ref = extractor._np_extract_fbank_features(padded[None], "cpu")[0]

    name = f"log-mel {kind} {seconds}s x{n_mels}"
    ours = log_mel_spectrogram(audio, n_mels=n_mels)
    assert ours.shape == (n_mels, 3000) and ours.dtype == torch.float32
    check(f"{name} (torch path)", ours, torch.from_numpy(out["input_features"][0]))
    precise = log_mel_spectrogram(torch.from_numpy(audio), n_mels, compute_dtype=torch.float64)
    check(f"{name} (numpy path, float64)", precise, torch.from_numpy(numpy_ref))
    assert mel_frames(len(audio)) == int(out["attention_mask"].sum())


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Random weights large enough that attention is far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "layer_norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif "embed" in name:
                p.copy_(noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise * 1.5 / math.sqrt(p[0].numel()))


@pytest.fixture(scope="module")
def models() -> tuple[HFWhisper, WhisperForConditionalGeneration]:
    torch.manual_seed(0)
    hf = HFWhisper(HFWhisperConfig(**TINY)).eval()
    randomize_(hf, seed=0)
    assert hf.proj_out.weight is hf.model.decoder.embed_tokens.weight
    ours = WhisperForConditionalGeneration(WhisperConfig.from_hf_dict(hf.config.to_dict())).eval()
    state = {k: v for k, v in hf.state_dict().items() if k != "proj_out.weight"}
    ours.load_state_dict(state, strict=True)
    return hf, ours


@pytest.fixture(scope="module")
def audio_features(models: Any) -> dict[str, Any]:
    """Mels of four clips, our encoder outputs and HF's (clips a-c batched, d alone)."""
    hf, ours = models
    clips = {"a": ("chirp", 2.0), "b": ("noise", 9.5), "c": ("sine", 31.0), "d": ("chirp", 5.0)}
    mel = {
        k: log_mel_spectrogram(make_audio(kind, s, seed=i))
        for i, (k, (kind, s)) in enumerate(clips.items())
    }
    with torch.no_grad():
        batch = torch.stack([mel["a"], mel["b"], mel["c"]])
        ours_abc, ref_abc = ours.encode(batch), hf.model.encoder(batch).last_hidden_state
        ours_d = ours.encode(mel["d"][None])
        ref_d = hf.model.encoder(mel["d"][None]).last_hidden_state
    return {
        "ours": dict(zip("abcd", [*ours_abc, ours_d[0]])),
        "ref": dict(zip("abcd", [*ref_abc, ref_d[0]])),
        "batch": (ours_abc, ref_abc),
    }


def test_parameter_names_are_hf_checkpoint_keys(models: Any) -> None:
    hf, ours = models
    expected = set(hf.state_dict()) - {"proj_out.weight"}
    assert {name for name, _ in ours.named_parameters()} == expected
    assert set(ours.state_dict()) == expected
    assert "model.encoder.layers.0.self_attn.k_proj.bias" not in expected


def test_encoder_matches_hf(models: Any, audio_features: dict[str, Any]) -> None:
    ours, ref = audio_features["batch"]
    assert ours.shape == (3, 1500, TINY["d_model"])
    check("encoder batch of 3", ours, ref)


class Pages:
    """Test-only page allocator: shuffled free pages, one page list per sequence."""

    def __init__(self, seed: int = 0) -> None:
        self.free = list(range(NUM_PAGES))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, int]]) -> PagedAttentionMetadata:
        """Metadata for a step appending ``n`` new tokens to each ``(seq, n)`` in order."""
        positions, slots, starts, seq_lens = [], [], [0], []
        for seq, n in chunks:
            pages = self.pages.setdefault(seq, [])
            old = self.lens.get(seq, 0)
            new = self.lens[seq] = old + n
            while len(pages) * PAGE_SIZE < new:
                pages.append(self.free.pop())
            for p in range(old, new):
                positions.append(p)
                slots.append(pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE)
            starts.append(starts[-1] + n)
            seq_lens.append(new)
        width = max(len(self.pages[seq]) for seq, _ in chunks)
        table = [self.pages[seq] + [0] * (width - len(self.pages[seq])) for seq, _ in chunks]
        return PagedAttentionMetadata(
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens),
            page_table=torch.tensor(table),
            page_size=PAGE_SIZE,
        )


def test_paged_decoder_matches_hf(models: Any, audio_features: dict[str, Any]) -> None:
    """Batched prefill of a-c, six decode steps, d's prefill joining the others' decodes."""
    hf, ours = models
    prompts = {
        "a": [SOT, LANG, TASK, NO_TIMESTAMPS],
        "b": [SOT, LANG, TASK],
        "c": [SOT, NO_TIMESTAMPS],
        "d": [SOT, TASK, NO_TIMESTAMPS],
    }
    steps: list[list[str]] = [["a", "b", "c"], *[["a", "b", "c"]] * 6]
    steps[3] = ["a", "d", "b", "c"]  # d's prefill lands between decodes
    for i in range(4, len(steps)):
        steps[i] = ["c", "a", "d", "b"]

    num_layers, num_heads, head_dim = ours.kv_layout()
    assert (num_layers, num_heads, head_dim) == (2, 4, 16)
    caches = allocate_kv_cache(
        num_layers, NUM_PAGES, PAGE_SIZE, num_heads, head_dim, torch.float32, "cpu"
    )
    assert ours.cross_layout() == (num_layers, 1500, num_heads, head_dim)
    cross_kv = CrossKVSlots(num_layers, 6, 1500, num_heads, head_dim, torch.float32, "cpu")
    slot = {"c": 4, "a": 1, "b": 5, "d": 2}  # out of order; d's K/V written while a-c decode
    with torch.no_grad():
        ours.write_cross_kv(torch.stack([audio_features["ours"][s] for s in "cab"]),
                            torch.tensor([slot[s] for s in "cab"]), cross_kv.layers)

    gen = torch.Generator().manual_seed(1)
    tokens: dict[str, list[int]] = {}  # every token fed so far, per sequence
    pages = Pages(seed=2)
    for i, seqs in enumerate(steps):
        new: dict[str, list[int]] = {}
        for s in seqs:
            if s in tokens:  # teacher-forced "sampled" token (random: argmax could tie)
                new[s] = [int(torch.randint(3, SOT, (1,), generator=gen))]
            else:
                new[s] = prompts[s]
            tokens.setdefault(s, []).extend(new[s])
        meta = pages.step([(s, len(new[s])) for s in seqs])
        ids = torch.tensor([t for s in seqs for t in new[s]])
        counts = [len(new[s]) for s in seqs]
        batch = CrossAttentionBatch.build(torch.tensor([slot[s] for s in seqs]), counts, frames=1500,
                                          sink=cross_kv.sink, backend="torch")
        with torch.no_grad():
            if i == 3:
                ours.write_cross_kv(audio_features["ours"]["d"][None], torch.tensor([slot["d"]]), cross_kv.layers)
            hidden = ours.decode(ids, meta, caches, cross_kv.layers, batch)
            logits = ours.compute_logits(hidden)
        assert hidden.shape == (len(ids), TINY["d_model"])

        refs = []
        for s in seqs:
            full = torch.tensor([tokens[s]])
            encoded = BaseModelOutput(last_hidden_state=audio_features["ref"][s][None])
            with torch.no_grad():
                out = hf(encoder_outputs=encoded, decoder_input_ids=full, use_cache=False)
            refs.append(out.logits[0, -len(new[s]) :])
        kind = "prefill" if i == 0 else ("prefill+decode" if i == 3 else "decode")
        check(f"decoder step {i} ({kind}, {seqs})", logits, torch.cat(refs))
