"""Omnilingual ASR CTC against transformers' ``OmniASRForCTC`` (5.25): a tiny random model in
fp32 on the CPU, loaded into ours from transformers' layout; CTC logits of a padded batch,
the per-frame argmax and the decoded text."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mstar.model.omniasr.checkpoint import from_hf_layout  # noqa: E402
from mstar.model.omniasr.config import OmniAsrConfig  # noqa: E402
from mstar.model.omniasr.modeling import OmniAsrCtc, normalize_utterance  # noqa: E402
from mstar.model.weights import load_weights  # noqa: E402

VOCAB = 40


def tiny_hf():
    from transformers import OmniASRCTCConfig, OmniASRForCTC

    config = OmniASRCTCConfig(vocab_size=VOCAB, audio_config=dict(
        hidden_size=32, conv_dim=[16, 16, 16], conv_kernel=[10, 3, 2], conv_stride=[5, 2, 2],
        num_attention_heads=4, num_hidden_layers=2, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        intermediate_size=64, hidden_act="gelu"))
    config.audio_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = OmniASRForCTC(config).eval()
    with torch.no_grad():  # every tensor random, norms and biases included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def ours_from(hf) -> OmniAsrCtc:
    audio = hf.config.audio_config
    config = OmniAsrConfig(model_dim=32, num_layers=2, num_heads=4, ffn_dim=64, vocab_size=VOCAB,
                           feature_layers=tuple(zip(audio.conv_dim, audio.conv_kernel, audio.conv_stride)),
                           pos_conv_kernel=16, pos_conv_groups=4)
    model = OmniAsrCtc(config).eval()
    load_weights(model, from_hf_layout(hf.state_dict().items()))
    return model


def batch(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 0.3 + 0.05 for n in lengths]


def hf_inputs(clips):
    from transformers.models.omniasr.feature_extraction_omniasr import OmniASRFeatureExtractor

    return OmniASRFeatureExtractor()([c.numpy() for c in clips], sampling_rate=16000)


def our_inputs(clips):
    waves = torch.zeros(len(clips), max(len(c) for c in clips))
    for row, clip in enumerate(clips):
        waves[row, :len(clip)] = normalize_utterance(clip)
    return waves, torch.tensor([len(c) for c in clips])


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_normalisation_matches_feature_extractor():
    clips = batch([3000, 4100])
    ref = hf_inputs(clips)["input_values"][:, 0]
    ours, _ = our_inputs(clips)
    assert rel(ours, ref) < 1e-6


@torch.no_grad()
def test_ctc_logits_and_argmax_match_transformers():
    hf = tiny_hf()
    ours = ours_from(hf)
    clips = batch([4000, 2600, 3333])
    inputs = hf_inputs(clips)
    ref = hf(**inputs).logits
    waves, lengths = our_inputs(clips)
    logits, frames = ours(waves, lengths)
    mask = hf._get_output_attention_mask(inputs["padding_mask"], target_length=ref.shape[1])
    assert frames.tolist() == mask.sum(-1).tolist()
    for row, n in enumerate(frames.tolist()):
        assert rel(logits[row, :n], ref[row, :n]) < 1e-5
    ids = hf.generate(**inputs)
    for row, got in enumerate(ours.greedy(logits, frames)):
        assert got == ids[row, :len(got)].tolist()


@torch.no_grad()
def test_batched_equals_solo():
    hf = tiny_hf()
    ours = ours_from(hf)
    clips = batch([4000, 1500])
    waves, lengths = our_inputs(clips)
    logits, frames = ours(waves, lengths)
    for row, clip in enumerate(clips):
        solo, n = ours(*our_inputs([clip]))
        assert int(n[0]) == int(frames[row])
        assert rel(logits[row, :int(n[0])], solo[0]) < 1e-5


@torch.no_grad()
def test_decoded_text_matches_transformers_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.models.parakeet.tokenization_parakeet import ParakeetTokenizer

    from mstar.model.omniasr.vocabulary import CtcVocabulary

    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["<s>", "<pad>", "</s>", "<unk>"] + [("\u2581" if i % 3 == 0 else "") + letters[i % 26] + letters[i // 26]
                                                  for i in range(4, VOCAB)]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<s>", "<pad>", "</s>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    reference = ParakeetTokenizer(tokenizer_file=str(path), pad_token="<s>", unk_token="<unk>")
    vocabulary = CtcVocabulary.from_tokenizer_json(path)

    hf = tiny_hf()
    ours = ours_from(hf)
    clips = batch([4000, 2600], seed=3)
    inputs = hf_inputs(clips)
    ids = hf.generate(**inputs)
    logits, frames = ours(*our_inputs(clips))
    for row, got in enumerate(ours.greedy(logits, frames)):
        expected = reference.decode(ids[row, :len(got)].tolist(), skip_special_tokens=True)
        assert vocabulary.decode(got) == expected.strip()
        assert vocabulary.decode(got)  # the random model says something
