"""Qwen3-ASR checkpoints: the released layout (``thinker.*``, the projector inside the audio
tower, the tied ``lm_head`` kept) and transformers' layout load into the same parameters,
coverage is checked both ways (a tensor nothing reads, a parameter nothing fills, each named),
and dummy weights need no tensors. The configs of both layouts read the same."""

from __future__ import annotations

import pytest
import torch

from mstar.model.qwen3_asr.checkpoint import Qwen3ASRCheckpoint
from mstar.model.weights import WeightLoadError
from tests.support.qwen3_asr import reference, write_released, write_transformers

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ref():
    return reference(seed=4)


def load(directory, dummy: bool = False):
    return Qwen3ASRCheckpoint.locate(str(directory)).load_model(CPU, torch.float32, dummy=dummy, seed=0)


def test_both_layouts_load_the_same_weights(ref, tmp_path) -> None:
    released = load(write_released(ref, tmp_path / "released"))
    hf = load(write_transformers(ref, tmp_path / "hf"))
    a, b = released.state_dict(), hf.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    want = ref.model.multi_modal_projector.linear_2.weight
    assert torch.equal(released.multi_modal_projector.linear_2.weight, want)
    assert torch.equal(released.audio_tower.layers[1].fc1.bias, ref.model.audio_tower.layers[1].fc1.bias)
    assert released.config == Qwen3ASRCheckpoint.locate(str(tmp_path / "hf")).config()


def test_an_unread_tensor_is_named(ref, tmp_path) -> None:
    directory = write_released(ref, tmp_path / "extra", extra={"thinker.audio_tower.stray.weight": torch.zeros(2)})
    with pytest.raises(WeightLoadError, match="audio_tower.stray.weight"):
        load(directory)


def test_a_missing_tensor_is_named(ref, tmp_path) -> None:
    directory = write_released(ref, tmp_path / "missing", drop="thinker.audio_tower.proj1.bias")
    with pytest.raises(WeightLoadError, match="multi_modal_projector.linear_1.bias"):
        load(directory)


def test_dummy_weights_read_no_tensors(ref, tmp_path) -> None:
    directory = write_released(ref, tmp_path / "dummy")
    (directory / "model.safetensors").unlink()
    model = load(directory, dummy=True)
    assert model.audio_tower.conv2d1.weight.abs().sum() > 0
    with torch.no_grad():
        out = model.encode([torch.randn(120, 16)])
    assert out[0].shape == (model.config.audio.positions(120), 32)
