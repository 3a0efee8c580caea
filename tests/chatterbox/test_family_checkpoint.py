"""A whole Chatterbox checkpoint directory in the released layout, tiny: ``t3_cfg.safetensors``
(the reference T3's own state dict, from ``record_reference.py``), ``s3gen.safetensors`` (the
reference ``S3Token2Wav``'s ``flow.`` / ``mel2wav.`` tensors from ``tests/s3gen``, with the S3
tokenizer under ``tokenizer.`` and CAMPPlus under ``speaker_encoder.`` at the reference's key
names and shapes from ``tests/speech_front``), ``ve.safetensors`` and ``conds.pt`` in the
reference's ``Conditionals.save`` layout. Every part loads with coverage checked both ways
(the loaders are strict: a stray tensor is named), the tensors land unchanged, and a missing
file is named."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.model.chatterbox.checkpoint import ChatterboxCheckpoint
from mstar.model.s3gen import s3gen_name_map
from mstar.model.speech_front import CampPlusConfig, S3TokenizerConfig, VoiceEncoderConfig
from tests.chatterbox.tiny import FIXTURES, tiny_config
from tests.s3gen.tiny import fixture as s3gen_fixture
from tests.s3gen.tiny import s3gen_config

FRONT = Path(__file__).parents[1] / "speech_front" / "fixtures"


def shaped(keys: dict[str, list[int]], prefix: str = "", seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {prefix + k: (torch.randn(shape, generator=g) * 0.1 if k.split(".")[-1] != "num_batches_tracked"
                         else torch.zeros(shape, dtype=torch.long)) for k, shape in keys.items()}


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chatterbox")
    shutil.copy(FIXTURES / "t3_english.safetensors", root / "t3_cfg.safetensors")
    record = s3gen_fixture("token2wav")
    tok, cam = torch.load(FRONT / "s3_tokenizer.pt")["v2"], torch.load(FRONT / "campplus.pt")
    s3gen = {k: v.contiguous() for k, v in record["state"].items()}
    s3gen |= shaped(tok["keys"], "tokenizer.", 1) | shaped(cam["keys"], "speaker_encoder.", 2)
    save_file(s3gen, root / "s3gen.safetensors")
    save_file(shaped(torch.load(FRONT / "voice_encoder.pt")["tiny"]["keys"], seed=3), root / "ve.safetensors")
    config = tiny_config("english")
    g = torch.Generator().manual_seed(4)
    gen = {"prompt_token": torch.randint(0, 50, (1, 20), generator=g), "prompt_token_len": torch.tensor([20]),
           "prompt_feat": torch.randn(1, 40, 80, generator=g), "prompt_feat_len": None,
           "embedding": torch.randn(1, record["config"]["speaker"], generator=g)}
    t3 = {"speaker_emb": torch.randn(1, config.speaker_embed_size, generator=g), "clap_emb": None,
          "cond_prompt_speech_tokens": torch.randint(0, 60, (1, 6), generator=g),
          "cond_prompt_speech_emb": None, "emotion_adv": torch.full((1, 1, 1), 0.5)}
    torch.save({"t3": t3, "gen": gen}, root / "conds.pt")
    return root


@pytest.fixture
def parts(directory, monkeypatch) -> ChatterboxCheckpoint:
    record = s3gen_fixture("token2wav")
    cam = torch.load(FRONT / "campplus.pt")["tiny"]
    ve = torch.load(FRONT / "voice_encoder.pt")["tiny_config"]
    monkeypatch.setattr(ChatterboxCheckpoint, "t3_config", lambda self: tiny_config("english"))
    monkeypatch.setattr(ChatterboxCheckpoint, "s3gen_config", lambda self: s3gen_config(record["config"]))
    monkeypatch.setattr(ChatterboxCheckpoint, "ve_config", lambda self: VoiceEncoderConfig(**ve))
    monkeypatch.setattr(ChatterboxCheckpoint, "tokenizer_config",
                        lambda self: S3TokenizerConfig(d_model=128, n_heads=2, n_layers=2))
    monkeypatch.setattr(ChatterboxCheckpoint, "campplus_config", lambda self: CampPlusConfig(**cam))
    return ChatterboxCheckpoint(directory, "english")


def test_every_part_loads_from_the_released_layout(parts, directory):
    t3 = parts.t3()
    s3gen = parts.s3gen()
    record = s3gen_fixture("token2wav")
    ours = s3gen.state_dict()
    direct = {s3gen_name_map(k): v for k, v in record["state"].items() if "parametrizations" not in k}
    direct = {k: v for k, v in direct.items() if k in ours}
    assert len(direct) > 100 and all(torch.equal(ours[k], v) for k, v in direct.items())
    t3_file = load_file(directory / "t3_cfg.safetensors")
    assert all(torch.equal(t3.state_dict()[k], v) for k, v in t3_file.items() if k in t3.state_dict())
    encoders = parts.clip_encoders()
    ve_state = {k: v for k, v in shaped(torch.load(FRONT / "voice_encoder.pt")["tiny"]["keys"], seed=3).items()
                if not k.startswith("similarity")}
    assert all(torch.equal(encoders.voice_encoder.state_dict()[k], v) for k, v in ve_state.items())
    voice = parts.builtin_voice()
    assert voice.speaker_emb.shape == (1, t3.config.speaker_embed_size)
    assert voice.s3gen.tokens.shape == (1, 20) and voice.s3gen.mel.shape == (1, 40, 80)
    assert voice.s3gen.xvector.shape == (1, record["config"]["speaker"])


def test_a_stray_tensor_is_named(parts, directory, tmp_path):
    for name in ("t3_cfg.safetensors", "s3gen.safetensors", "conds.pt"):
        shutil.copy(directory / name, tmp_path / name)
    keys = torch.load(FRONT / "voice_encoder.pt")["tiny"]["keys"]
    save_file(shaped(keys, seed=3) | {"stray.weight": torch.zeros(2)}, tmp_path / "ve.safetensors")
    with pytest.raises(Exception, match="stray.weight"):
        ChatterboxCheckpoint(tmp_path, "english").clip_encoders()
    (tmp_path / "conds.pt").unlink()
    with pytest.raises(FileNotFoundError, match="conds.pt"):
        ChatterboxCheckpoint(tmp_path, "english").builtin_voice()
