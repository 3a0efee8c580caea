"""The released layout loads into the models that match the reference (both fixtures), dummy
weights need no files, and coverage fails both ways naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mstar.model.fish_s2_pro.checkpoint import FishS2ProCheckpoint
from mstar.model.fish_s2_pro.codec import CodecConfig
from mstar.model.fish_s2_pro.codec_encoder import EncoderConfig
from mstar.model.fish_s2_pro.weights import dual_ar_tensors
from mstar.model.weights import WeightLoadError

FIXTURES = Path(__file__).parent / "fixtures"
AR = torch.load(FIXTURES / "dual_ar.pt")
CODEC = torch.load(FIXTURES / "codec.pt")
ENCODER = torch.load(FIXTURES / "codec_encoder.pt")


def release(tmp_path: Path, ar_state: dict | None = None) -> FishS2ProCheckpoint:
    (tmp_path / "config.json").write_text(json.dumps(AR["config"]))
    tokens = {"<|im_end|>": 2, **{f"<|semantic:{i}|>": AR["semantic_begin_id"] + i for i in range(16)}}
    (tmp_path / "special_tokens.json").write_text(json.dumps(tokens))
    state = AR["state_dict"] if ar_state is None else ar_state
    torch.save({"model." + k: v for k, v in state.items()}, tmp_path / "model.pth")
    torch.save({"generator." + k: v for k, v in CODEC["state_dict"].items()}, tmp_path / "codec.pth")
    return FishS2ProCheckpoint(tmp_path)


def test_released_files_give_the_reference_models(tmp_path):
    ckpt = release(tmp_path)
    config = ckpt.config()
    assert (config.semantic_begin_id, config.eos_token_id, config.num_codebooks) == (AR["semantic_begin_id"], 2, 4)
    model = ckpt.dual_ar(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    direct = dual_ar_tensors(config, AR["state_dict"])  # what the parity test loads
    loaded = model.state_dict()
    assert set(loaded) == set(direct)
    assert all(torch.equal(loaded[name], direct[name]) for name in direct)
    codec = ckpt.codec(torch.device("cpu"), dummy=False, seed=0, config=CodecConfig(**CODEC["config"]))
    with torch.no_grad():
        audio = codec.decode(CODEC["codes"])
    assert (audio - CODEC["audio"]).abs().max() <= 1e-4 * CODEC["audio"].abs().max()


def test_missing_tensor_is_named(tmp_path):
    state = {k: v for k, v in AR["state_dict"].items() if k != "fast_norm.weight"}
    with pytest.raises(WeightLoadError, match="fast.fast_norm.weight"):
        release(tmp_path, state).dual_ar(torch.device("cpu"), torch.float32, dummy=False, seed=0)


def test_extra_tensor_is_named(tmp_path):
    state = {**AR["state_dict"], "audio_projector.weight": torch.zeros(2, 2)}
    with pytest.raises(KeyError, match="audio_projector.weight"):
        release(tmp_path, state).dual_ar(torch.device("cpu"), torch.float32, dummy=False, seed=0)


def test_dummy_weights_need_no_files(tmp_path):
    ckpt = release(tmp_path)
    config = ckpt.config()
    (tmp_path / "model.pth").unlink()
    (tmp_path / "codec.pth").unlink()
    a = ckpt.dual_ar(torch.device("cpu"), torch.float32, dummy=True, seed=3, config=config)
    b = ckpt.dual_ar(torch.device("cpu"), torch.float32, dummy=True, seed=3, config=config)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    codec = ckpt.codec(torch.device("cpu"), dummy=True, seed=4, config=CodecConfig(**CODEC["config"]))
    with torch.no_grad():
        assert torch.isfinite(codec.decode(CODEC["codes"])).all()


def test_codec_encoder_from_released_codec(tmp_path):
    torch.save({"generator." + k: v for k, v in ENCODER["state_dict"].items()}, tmp_path / "codec.pth")
    encoder = FishS2ProCheckpoint(tmp_path).codec_encoder(torch.device("cpu"), dummy=False, seed=0,
                                                          config=CodecConfig(**ENCODER["config"]),
                                                          encoder=EncoderConfig(**ENCODER["encoder"]))
    with torch.no_grad():
        assert torch.equal(encoder(ENCODER["audio"]), ENCODER["codes"])


def test_s2_release_reads_its_config_and_names(tmp_path):
    s2 = torch.load(FIXTURES / "dual_ar_s2.pt")
    (tmp_path / "config.json").write_text(json.dumps(s2["config"]))
    (tmp_path / "special_tokens.json").write_text(json.dumps({"<|im_end|>": 2}))  # semantic ids: in the config
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in s2["state_dict"].items()}, tmp_path / "model.safetensors")
    ckpt = FishS2ProCheckpoint(tmp_path)
    config = ckpt.config()
    assert (config.semantic_begin_id, config.eos_token_id, config.norm_fastlayer_input) == (70, 2, True)
    model = ckpt.dual_ar(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    direct = dual_ar_tensors(config, s2["state_dict"])
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in direct.items())
