"""OmniVoice's checkpoint in the released layout: a tiny random ``OmniVoice`` (omnivoice 0.2.1)
and ``HiggsAudioV2TokenizerModel`` (transformers 5.25) written by their own ``save_pretrained``
into ``<dir>/`` and ``<dir>/audio_tokenizer/``, loaded by ours with coverage both ways."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from omnivoice_reference import hf_codec_config, reference, stand_in_audio_io
from safetensors.torch import load_file, save_file

from mstar.model.omnivoice import tiny_config
from mstar.model.omnivoice.checkpoint import OmniVoiceCheckpoint, fold_weight_norm
from mstar.model.weights import WeightLoadError


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    ref_module = reference()
    stand_in_audio_io()
    from transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerModel,
    )

    config = tiny_config()
    directory = tmp_path_factory.mktemp("omnivoice")
    torch.manual_seed(0)
    ref = ref_module.OmniVoice(ref_module.OmniVoiceConfig(
        audio_vocab_size=config.audio_vocab_size, audio_mask_id=config.audio_mask_id,
        num_audio_codebook=config.num_audio_codebook, llm_config=config.llm.to_hf_dict())).eval()
    ref.save_pretrained(directory)
    codec = HiggsAudioV2TokenizerModel(hf_codec_config(config.codec)).eval()
    with torch.no_grad():
        for q in codec.quantizer.quantizers:
            q.codebook.embed.normal_()
    codec.save_pretrained(directory / "audio_tokenizer")
    return directory, ref, codec


@torch.no_grad()
def test_release_loads_and_matches_the_references(release):
    directory, ref, codec = release
    checkpoint = OmniVoiceCheckpoint.locate(str(directory))
    config, tiny = checkpoint.config(), tiny_config()
    for key, value in tiny.codec.semantic.items():
        assert config.codec.semantic[key] == value, key
    assert replace(config, codec=replace(config.codec, semantic={})) == replace(tiny, codec=replace(tiny.codec,
                                                                                                     semantic={}))
    model = checkpoint.load_model("cpu", torch.float32, dummy=False, seed=0)
    ids = torch.randint(0, 1024, (2, 4, 9))
    audio = torch.ones(2, 9, dtype=torch.bool)
    audio[:, :3] = False
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool)
    expected = ref(input_ids=ids, audio_mask=audio, attention_mask=mask).logits
    got = model.backbone(ids, audio, mask)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    wave = codec.decode(ids[:, :, :5], return_dict=False)[:, 0]
    assert set(model.codec.state_dict()) >= {"semantic_model.encoder.layers.0.attention.k_proj.weight", "fc.weight"}
    assert (model.codec(ids[:, :, :5]) - wave).abs().max() <= 1e-4 * wave.abs().max()


def test_a_missing_or_extra_tensor_is_named(release, tmp_path):
    directory, _, _ = release
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    weights = load_file(copy / "model.safetensors")
    weights.pop("audio_heads.weight")
    weights["llm.surplus"] = torch.zeros(1)
    save_file(weights, copy / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"audio_heads\.weight.*llm\.surplus"):
        OmniVoiceCheckpoint.locate(str(copy)).load_model("cpu", torch.float32, dummy=False, seed=0)
    codec_file = next((copy / "audio_tokenizer").glob("*.safetensors"))
    codec_weights = load_file(codec_file)
    codec_weights.pop("acoustic_decoder.conv2.weight")
    save_file(codec_weights, codec_file)
    save_file(load_file(directory / "model.safetensors"), copy / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"acoustic_decoder\.conv2\.weight"):
        OmniVoiceCheckpoint.locate(str(copy)).load_model("cpu", torch.float32, dummy=False, seed=0)


@pytest.mark.filterwarnings("ignore:.*weight_norm. is deprecated:FutureWarning")
def test_weight_norm_pairs_fold_into_plain_weights():
    conv = torch.nn.ConvTranspose1d(6, 4, 5)
    normed = torch.nn.utils.parametrizations.weight_norm(torch.nn.ConvTranspose1d(6, 4, 5))
    named = dict(normed.named_parameters())
    old = torch.nn.utils.weight_norm(conv)
    for tensors in (
        [("a.parametrizations.weight.original0", named["parametrizations.weight.original0"]),
         ("a.bias", named["bias"]),
         ("a.parametrizations.weight.original1", named["parametrizations.weight.original1"])],
        [("a.weight_v", old.weight_v), ("a.weight_g", old.weight_g)],
    ):
        folded = dict(fold_weight_norm((n, t.detach()) for n, t in tensors))
        expected = normed.weight if "original0" in tensors[0][0] else old.weight
        torch.testing.assert_close(folded["a.weight"], expected.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="pair"):
        list(fold_weight_norm([("a.weight_g", torch.ones(2, 1, 1))]))


def test_dummy_weights_need_no_tensors(release):
    directory, _, _ = release
    a = OmniVoiceCheckpoint.locate(str(directory)).load_model("cpu", torch.float32, dummy=True, seed=3)
    b = OmniVoiceCheckpoint.locate(str(directory)).load_model("cpu", torch.float32, dummy=True, seed=3)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert a.codec.quantizer.quantizers[0].codebook.embed.std() > 0.5


def test_a_release_without_its_codec_folder_takes_the_codec_repo(release, tmp_path, monkeypatch):
    import shutil
    from pathlib import Path

    import mstar.model.weights as weights
    from mstar.model.omnivoice.checkpoint import CODEC_HUB_ID

    directory, _, _ = release
    bare = tmp_path / "bare"
    shutil.copytree(directory, bare, ignore=shutil.ignore_patterns("audio_tokenizer"))
    asked = []

    def resolve(path, cache_dir=None, allow_patterns=None):
        asked.append(str(path))
        return directory / "audio_tokenizer" if str(path) == CODEC_HUB_ID else Path(path)

    monkeypatch.setattr(weights, "resolve_model_path", resolve)
    checkpoint = OmniVoiceCheckpoint.locate(str(bare))
    assert asked == [str(bare), CODEC_HUB_ID]
    model = checkpoint.load_model("cpu", torch.float32, dummy=False, seed=0)
    expected = OmniVoiceCheckpoint.locate(str(directory)).load_model("cpu", torch.float32, dummy=False, seed=0)
    for (name, a), (_, b) in zip(model.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(a, b), name
