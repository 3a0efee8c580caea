"""Omnilingual ASR CTC against the reference package's own outputs (recorded by
``record_reference.py`` with omnilingual-asr 0.2.0, fairseq2 0.6, torch 2.8.0; the versions are
in each fixture): a tiny random fairseq2 ``Wav2Vec2AsrModel``'s state dict loaded by name into
ours (the release's layout, weight-normed position conv included), its logits on a padded
batch; the utterance normalisation; the CTC decoding through a real SentencePiece model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mstar.model.omniasr.config import OmniAsrConfig
from mstar.model.omniasr.modeling import OmniAsrCtc, normalize_utterance
from mstar.model.omniasr.vocabulary import CtcVocabulary
from mstar.model.weights import load_weights

FIXTURES = Path(__file__).parent / "fixtures"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def test_logits_match_the_reference_model():
    recorded = torch.load(FIXTURES / "ctc_tiny.pt", weights_only=True)
    assert recorded["versions"]["omnilingual-asr"] == "0.2.0"
    config = OmniAsrConfig(model_dim=32, num_layers=2, num_heads=4, ffn_dim=64, vocab_size=24,
                           feature_layers=((16, 10, 5), (16, 3, 2), (16, 2, 2)), pos_conv_kernel=16, pos_conv_groups=4)
    model = OmniAsrCtc(config).eval()
    load_weights(model, recorded["state"].items())  # coverage both ways: the names are the release's
    logits, frames = model(recorded["waves"], recorded["lengths"])
    assert frames.tolist() == recorded["frames"].tolist()
    ref = recorded["logits"]
    for row, n in enumerate(frames.tolist()):
        assert rel(logits[row, :n], ref[row, :n]) < 1e-5
        assert logits[row, :n].argmax(-1).tolist() == ref[row, :n].argmax(-1).tolist()


def test_normalisation_matches_the_reference():
    recorded = torch.load(FIXTURES / "normalize.pt", weights_only=True)
    assert rel(normalize_utterance(recorded["clip"]), recorded["normalized"]) < 1e-6


def test_decoding_matches_the_reference_tokenizer():
    recorded = json.loads((FIXTURES / "decode.json").read_text())
    vocab = CtcVocabulary.from_sentencepiece(FIXTURES / "tokenizer.model")
    assert len(vocab) == recorded["vocab_size"]
    for case in recorded["cases"]:
        assert vocab.decode(case["frames"]) == case["text"].strip(), case
