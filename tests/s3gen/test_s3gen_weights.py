"""Loading S3Gen from the released ``s3gen.safetensors`` layout.

The tiny checkpoint is the reference ``S3Token2Wav``'s own state dict (``token2wav.pt``,
recorded by ``record_reference.py`` from ``chatterbox-tts==0.1.7``: weight-norm
parametrizations and all); the released-size names and shapes are that class's state dict at
its shipped size (``s3gen_keys.json``), which is what ``s3gen.safetensors`` holds.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mstar.model.s3gen import (
    FRONT_END_PREFIXES,
    S3GEN_FILES,
    S3Gen,
    S3GenConfig,
    S3GenPrompt,
    load_s3gen,
    read_s3gen,
    s3gen_name_map,
    s3gen_tensors,
)
from mstar.model.weights import WeightLoadError
from tests.s3gen.tiny import FIXTURES, fixture, s3gen_config

TOKEN2WAV = fixture("token2wav")


def tiny() -> S3Gen:
    return S3Gen(s3gen_config(TOKEN2WAV["config"])).eval()


def test_every_released_tensor_fills_a_parameter_and_back():
    """Strict both ways, the front-end encoders' tensors skipped; the values land where the
    names say (a folded weight-norm conv and a renamed front tensor checked)."""
    state = dict(TOKEN2WAV["state"])
    state["speaker_encoder.xvector.dense.weight"] = torch.zeros(3)
    state["tokenizer.encoder.conv1.weight"] = torch.zeros(3)
    model = tiny()
    load_s3gen(model, state.items())
    assert torch.equal(model.front.token_embedding.weight, state["flow.input_embedding.weight"])
    assert torch.equal(model.encoder.up_encoders[3].self_attn.pos_bias_v,
                       state["flow.encoder.up_encoders.3.self_attn.pos_bias_v"])
    g = state["mel2wav.conv_pre.parametrizations.weight.original0"]
    v = state["mel2wav.conv_pre.parametrizations.weight.original1"]
    assert torch.allclose(model.vocoder.conv_pre.weight, g * v / v.norm(dim=(1, 2), keepdim=True))


@pytest.mark.parametrize("name", ["token2wav", "turbo"])
def test_reading_a_checkpoint_directory(tmp_path, name):
    """The S3Gen file of a directory that also holds other models' files; Turbo's by its name."""
    record = fixture(name)
    config = s3gen_config(record["config"] | {"meanflow": record["meanflow"]})
    save_file({k: v.contiguous() for k, v in record["state"].items()}, tmp_path / S3GEN_FILES[config.meanflow])
    save_file({"tfmr.wte.weight": torch.zeros(2)}, tmp_path / "t3_cfg.safetensors")
    model = read_s3gen(tmp_path, config)
    assert not model.training
    assert torch.equal(model.estimator.final_proj.weight, record["state"]["flow.decoder.estimator.final_proj.weight"])
    with pytest.raises(FileNotFoundError, match=S3GEN_FILES[not config.meanflow]):
        read_s3gen(tmp_path, s3gen_config(record["config"] | {"meanflow": not record["meanflow"]}))


@pytest.mark.parametrize("drop", ["flow.encoder.encoders.1.norm_ff.bias", "mel2wav.ups.2.bias",
                                  "flow.decoder.estimator.final_proj.weight", "flow.spk_embed_affine_layer.bias"])
def test_a_missing_tensor_is_named(drop):
    state = {k: v for k, v in TOKEN2WAV["state"].items() if k != drop}
    with pytest.raises(WeightLoadError, match="did not fill"):
        load_s3gen(tiny(), state.items())


def test_an_unknown_tensor_is_named():
    state = dict(TOKEN2WAV["state"]) | {"flow.length_regulator.weight": torch.zeros(1)}
    with pytest.raises(WeightLoadError, match="flow.length_regulator.weight"):
        load_s3gen(tiny(), state.items())


def test_half_a_weight_norm_pair_is_named():
    state = {k: v for k, v in TOKEN2WAV["state"].items() if k != "mel2wav.conv_post.parametrizations.weight.original0"}
    with pytest.raises(WeightLoadError, match="conv_post"):
        load_s3gen(tiny(), state.items())


@pytest.mark.slow
@pytest.mark.parametrize("turbo", [False, True])
def test_released_names_and_shapes(turbo):
    """The released size on the meta device: every ``flow.``/``mel2wav.`` tensor of
    ``s3gen.safetensors`` (Turbo: ``s3gen_meanflow.safetensors``) maps onto a parameter of
    ``S3Gen()`` (``S3Gen(S3GenConfig.turbo())``) of its shape, and every parameter is named;
    the other prefixes are the front-end encoders'."""
    released = json.loads((FIXTURES / "s3gen_keys.json").read_text())
    assert {f"{p}." for p in released["other_prefixes"]} == set(FRONT_END_PREFIXES)
    names = released["tensors"] | (released["meanflow_extra"] if turbo else {})
    with torch.device("meta"):
        model = S3Gen(S3GenConfig.turbo() if turbo else S3GenConfig())
        tensors = [(name, torch.empty(shape)) for name, shape in names.items()]
    folded = list(s3gen_tensors(tensors))
    mapped = {s3gen_name_map(name): tuple(t.shape) for name, t in folded}
    assert len(mapped) == len(folded)  # no two released tensors fill one parameter
    ours = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert mapped == ours


@pytest.mark.slow
@pytest.mark.parametrize("turbo", [False, True])
def test_released_size_decodes(turbo):
    """The released geometry end to end on random weights: one second of new tokens after a
    short prompt gives one second of audio, finite and within the vocoder's limit."""
    torch.manual_seed(0)
    model = S3Gen(S3GenConfig.turbo() if turbo else S3GenConfig()).eval()
    prompt = S3GenPrompt(torch.randint(0, 6561, (1, 10)), torch.randn(1, 20, 80), torch.randn(1, 192))
    wave = model.token2wav(torch.randint(0, 6561, (1, 25)), prompt, generator=torch.Generator().manual_seed(0),
                           n_cfm_timesteps=2)
    assert wave.shape == (1, 24000)
    assert torch.isfinite(wave).all() and wave.abs().max() <= model.config.vocoder.audio_limit
