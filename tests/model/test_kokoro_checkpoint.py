"""Kokoro's weights load from the released layout (hexgrad/Kokoro-82M: config.json,
kokoro-v1_0.pth as ``{module: state dict}`` with ``module.`` keys and weight-norm pairs,
voices/*.pt) found in a hub cache, with coverage checked both ways; dummy weights build the
real shapes."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from mstar.model.kokoro import KokoroConfig, KokoroModel
from mstar.model.kokoro.checkpoint import KokoroCheckpoint, load_kokoro_state
from mstar.model.weights import WeightLoadError, fill_weights
from tests.support.kokoro import (
    TINY_CONFIG,
    VOICE_LEN,
    hub_snapshot,
    reference_model,
    released_state,
    voice_table,
    write_checkpoint,
)

pytest.importorskip("kokoro", reason="the reference: pip install kokoro==0.9.4")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_model(tmp_path_factory.mktemp("kokoro"), seed=3)


def ids_of(phonemes: str) -> torch.Tensor:
    return torch.tensor([[0, *(TINY_CONFIG["vocab"][p] for p in phonemes), 0]])


def test_hub_cache_layout_loads_and_speaks_like_the_reference(reference, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_checkpoint(hub_snapshot(tmp_path), reference, voices=("af_test", "bm_test"))
    checkpoint = KokoroCheckpoint.locate("hexgrad/Kokoro-82M", cache_dir=str(tmp_path))
    assert checkpoint.voice_names() == ["af_test", "bm_test"]
    table = checkpoint.voice("af_test")
    assert table.shape == (VOICE_LEN, 1, 256) and torch.equal(table, voice_table(100))
    model = checkpoint.load_model("cpu")
    ids = ids_of("hɛlo wɔld")
    ref_s = table[ids.shape[1] - 3]  # KPipeline's row: the phoneme count minus one
    torch.manual_seed(4)
    want, want_dur = reference.forward_with_tokens(ids, ref_s, 1.1)
    (got,), got_dur = model(ids, ref_s, 1.1, generators=[torch.Generator().manual_seed(4)])
    assert torch.equal(got_dur[0], want_dur)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


def fresh() -> KokoroModel:
    return KokoroModel(KokoroConfig.from_dict(TINY_CONFIG))


def test_keys_without_the_module_prefix_load(reference):
    load_kokoro_state(fresh(), released_state(reference, prefix=""))


def test_a_missing_tensor_is_named(reference):
    state = released_state(reference)
    del state["predictor"]["module.F0_proj.weight"]
    with pytest.raises(WeightLoadError, match=re.escape("predictor.F0_proj.weight")):
        load_kokoro_state(fresh(), state)


def test_an_unused_tensor_is_named(reference):
    state = released_state(reference)
    state["decoder"]["module.extra.weight"] = torch.zeros(2)
    with pytest.raises(WeightLoadError, match=re.escape("decoder.extra.weight")):
        load_kokoro_state(fresh(), state)


def test_a_lone_weight_norm_half_is_named(reference):
    state = released_state(reference)
    del state["text_encoder"]["module.cnn.0.0.weight_v"]
    with pytest.raises(WeightLoadError, match="cnn.0.0.weight_g"):
        load_kokoro_state(fresh(), state)


def test_an_unknown_module_is_named(reference):
    state = released_state(reference) | {"style_encoder": {}}
    with pytest.raises(WeightLoadError, match="style_encoder"):
        load_kokoro_state(fresh(), state)


def test_absent_adain_affines_take_the_identity_like_kmodel(reference):
    """The released file may lack the AdaIN instance norms' affines (trained without them);
    KModel's fallback load keeps their init (1, 0), and so do we."""
    affine = re.compile(r"(norm[12]|adain[12]\.\d+)\.norm\.(weight|bias)$")
    state = released_state(reference)
    dropped = 0
    for module in state.values():
        for key in [k for k in module if affine.search(k)]:
            del module[key]
            dropped += 1
    assert dropped > 50
    ours = fresh().eval()
    load_kokoro_state(ours, state)
    ref = copy.deepcopy(reference)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if affine.search(name):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
    ids, ref_s = ids_of("ðə kæt"), torch.randn(1, 256, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    want, _ = ref.forward_with_tokens(ids, ref_s, 1.0)
    (got,), _ = ours(ids, ref_s, generators=[torch.Generator().manual_seed(0)])
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_config_names_an_unknown_key():
    with pytest.raises(ValueError, match="speaker_count"):
        KokoroConfig.from_dict(TINY_CONFIG | {"speaker_count": 3})
    with pytest.raises(ValueError, match="upsample_initial_channel"):
        KokoroConfig.from_dict(TINY_CONFIG | {"istftnet": TINY_CONFIG["istftnet"] | {"upsample_initial_channel": 256}})


def test_dummy_weights_have_kokoro_82m_shapes():
    config = KokoroConfig(vocab={"a": 1})
    model = fill_weights(KokoroModel(config), lambda: (), dummy=True, seed=0)
    count = sum(p.numel() for p in model.parameters())
    # 81.8M in the released file, less PL-BERT's pooler (768 x 768 + 768) that we drop
    assert 81_000_000 < count < 82_000_000, count
    assert config.samples_per_frame == 600 and config.max_input_tokens == 512
