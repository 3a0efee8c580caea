"""T3 weight loading in the released key layouts, coverage checked both ways.

``fixtures/t3_released_shapes.json`` lists every key (and shape) of the reference T3's
``state_dict`` at the real sizes of each variant, recorded by ``record_reference.py`` on the
meta device: the released files load into exactly these keys with ``strict``. Our model, also
built on the meta device, must take every one of them but the two T3 drops on purpose, and
leave nothing unfilled. The tiny fixtures' files (the reference's own ``state_dict``) load the
same way; a missing or an extra tensor is named.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.model.chatterbox.config import T3Config
from mstar.model.chatterbox.t3 import T3
from mstar.model.chatterbox.t3_checkpoint import T3_FILES, UNUSED_KEYS, load_t3, t3_name_map
from mstar.model.weights import WeightLoadError, load_weights
from tests.chatterbox.tiny import FIXTURES, tiny_config

VARIANTS = ("english", "multilingual", "turbo")
RELEASED = json.loads((FIXTURES / "t3_released_shapes.json").read_text())


@pytest.mark.parametrize("variant", VARIANTS)
def test_real_size_model_takes_every_released_key(variant):
    with torch.device("meta"):
        model = T3(T3Config.for_variant(variant))
        tensors = [(name, torch.empty(shape)) for name, shape in RELEASED[variant].items()]
    load_weights(model, tensors, name_map=t3_name_map)  # strict: raises on a gap either way
    dropped = sorted(name for name in RELEASED[variant] if t3_name_map(name) is None)
    assert dropped == sorted(UNUSED_KEYS & RELEASED[variant].keys())
    assert "text_head.weight" in dropped


def test_real_size_counts():
    """The English backbone is the 520M Llama (30 layers of 1024), Turbo's GPT-2 medium."""
    with torch.device("meta"):
        english, turbo = T3(T3Config.english()), T3(T3Config.turbo())
    assert len(english.tfmr.layers) == 30 and len(turbo.tfmr.h) == 24
    backbone = sum(p.numel() for p in english.tfmr.parameters())
    assert 450e6 < backbone < 560e6


@pytest.fixture
def released_dir(tmp_path):
    def make(variant: str, edit=None):
        directory = tmp_path / variant
        directory.mkdir(exist_ok=True)
        tensors = load_file(FIXTURES / f"t3_{variant}.safetensors")
        if edit is not None:
            edit(tensors)
        save_file(tensors, str(directory / T3_FILES[variant]))
        return directory
    return make


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_missing_tensor_is_named(released_dir, variant):
    directory = released_dir(variant, lambda t: t.pop("speech_head.weight"))
    with pytest.raises(WeightLoadError, match="speech_head.weight"):
        load_t3(directory, tiny_config(variant))


def test_an_extra_tensor_is_named(released_dir):
    directory = released_dir("english", lambda t: t.update({"cond_enc.clap.weight": torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match="cond_enc.clap.weight"):
        load_t3(directory, tiny_config("english"))


def test_the_variant_file_name_is_required(tmp_path):
    shutil.copy(FIXTURES / "t3_english.safetensors", tmp_path / "t3.safetensors")
    with pytest.raises(FileNotFoundError, match="t3_cfg.safetensors"):
        load_t3(tmp_path, tiny_config("english"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_dummy_weights_are_seeded_and_usable(variant):
    a = load_t3(None, tiny_config(variant), dummy=True, seed=3)
    b = load_t3(None, tiny_config(variant), dummy=True, seed=3)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    for module in a.modules():
        if isinstance(module, torch.nn.LayerNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight))
