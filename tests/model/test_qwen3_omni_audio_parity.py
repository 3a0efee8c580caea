"""Parity of Qwen3-Omni's audio encoder (AuT) with transformers' on a tiny random config (fp32,
CPU): two clips in one call, chunked convolutions and windowed attention; then the thinker's
logits for an audio + text prompt (the encoder's rows spliced over the audio placeholders) at
prefill and at decode steps."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_omni_moe")

from mstar.layers.paged_kv import allocate_kv_cache  # noqa: E402
from mstar.model.qwen3_omni import Qwen3OmniTextConfig, Qwen3OmniThinkerForCausalLM  # noqa: E402
from mstar.model.qwen3_omni.audio import Qwen3OmniAudioConfig, Qwen3OmniAudioEncoder, audio_token_count  # noqa: E402
from mstar.model.qwen3_omni.checkpoint import load_audio_tower, load_thinker_text  # noqa: E402
from mstar.model.qwen3_omni.inputs import audio_run, splice_features  # noqa: E402
from mstar.model.weights import WeightLoadError  # noqa: E402
from tests.support.pages import Pages  # noqa: E402
from tests.support.qwen3_omni import AUDIO_END, AUDIO_START, AUDIO_TOKEN, reference_thinker, released_keys  # noqa: E402

FRAMES = (250, 130)  # 13 + 13 + 7 and 13 + 4 tokens; windows of 2 chunks (26 tokens)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def reference():
    return reference_thinker(seed=4)


@pytest.fixture(scope="module")
def encoder(reference) -> Qwen3OmniAudioEncoder:
    model = Qwen3OmniAudioEncoder(Qwen3OmniAudioConfig.from_hf_dict(reference.config.to_dict())).eval()
    load_audio_tower(model, released_keys(reference))
    return model


@pytest.fixture(scope="module")
def mels() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(16, n, generator=gen) for n in FRAMES]


def test_token_counts_match_transformers() -> None:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    for frames in (1, 7, 99, 100, 101, 250, 1000, 1234):
        assert audio_token_count(frames) == int(_get_feat_extract_output_lengths(torch.tensor(frames)))


@torch.no_grad()
def test_encoder_matches_transformers(reference, encoder, mels) -> None:
    want = reference.model.audio_tower(torch.cat(mels, dim=1), feature_lens=torch.tensor(FRAMES)).last_hidden_state
    got = encoder(mels)
    assert [g.shape[0] for g in got] == [33, 17]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_audio_prompt_logits(reference, encoder, mels) -> None:
    text = Qwen3OmniThinkerForCausalLM(Qwen3OmniTextConfig.from_hf_dict(reference.config.to_dict())).eval()
    load_thinker_text(text, released_keys(reference))
    counts = [audio_token_count(m.shape[1]) for m in mels]
    prompt = [5, 17, *audio_run(counts[0], AUDIO_START, AUDIO_TOKEN, AUDIO_END), 40, 41,
              *audio_run(counts[1], AUDIO_START, AUDIO_TOKEN, AUDIO_END), 7, 9, 11]
    features = torch.zeros(2, 16, max(FRAMES))
    mask = torch.zeros(2, max(FRAMES), dtype=torch.long)
    for i, m in enumerate(mels):
        features[i, :, : m.shape[1]] = m
        mask[i, : m.shape[1]] = 1

    def hf_logits(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens])
        return reference(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=features,
                         feature_attention_mask=mask, use_cache=False).logits[0]

    config = text.config
    caches = allocate_kv_cache(config.num_hidden_layers, 32, 8, config.num_key_value_heads, config.head_dim,
                               torch.float32, "cpu")
    pages = Pages(32, 8, seed=6)
    ids = torch.tensor(prompt)
    embeds = splice_features(text.embed_input_ids(ids), ids, AUDIO_TOKEN, encoder(mels))
    logits = text.compute_logits(text(None, pages.step([("a", len(prompt))]), caches, inputs_embeds=embeds))
    want = hf_logits(prompt)
    worst = rel_err(logits, want)
    tokens = list(prompt)
    for _ in range(3):
        nxt = int(logits[-1].argmax())
        tokens.append(nxt)
        logits = text.compute_logits(text(torch.tensor([nxt]), pages.step([("a", 1)]), caches))
        worst = max(worst, rel_err(logits, hf_logits(tokens)[-1:]))
    print(f"[parity] qwen3-omni thinker audio+text: worst logits rel err {worst:.2e}")
    assert worst < 1e-4


def test_splice_counts_must_match() -> None:
    ids = torch.tensor([1, AUDIO_TOKEN, AUDIO_TOKEN, 2])
    with pytest.raises(ValueError, match="2 audio placeholder tokens for 3"):
        splice_features(torch.zeros(4, 8), ids, AUDIO_TOKEN, [torch.zeros(3, 8)])


def test_audio_tower_coverage(reference) -> None:
    config = Qwen3OmniAudioConfig.from_hf_dict(reference.config.to_dict())
    keys = [(n, t) for n, t in released_keys(reference) if n != "thinker.audio_tower.conv_out.weight"]
    with pytest.raises(WeightLoadError, match="conv_out.weight"):
        load_audio_tower(Qwen3OmniAudioEncoder(config), keys)


@pytest.mark.parametrize("samples", [16000, 24001, 7919])
def test_mel_front_matches_feature_extractor(samples: int) -> None:
    from transformers import WhisperFeatureExtractor

    from mstar.model.qwen3_omni.audio import mel_features

    wave = torch.randn(samples, generator=torch.Generator().manual_seed(samples)) * 0.1
    out = WhisperFeatureExtractor(feature_size=128)(wave.numpy(), sampling_rate=16000, padding=True,
                                                     truncation=False, return_attention_mask=True,
                                                     return_tensors="pt")
    got = mel_features(wave)
    assert got.shape[1] == int(out["attention_mask"].sum()) == samples // 160
    torch.testing.assert_close(got, out["input_features"][0], rtol=0, atol=1e-6)
