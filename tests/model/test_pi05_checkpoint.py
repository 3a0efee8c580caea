"""Pi0.5's checkpoint: a lerobot policy directory in the released key layout loads with two-way
coverage into a model equal to the reference; dummy weights; the normalisation statistics and
the tokenizer come from the directory's own files."""

from __future__ import annotations

import pytest
import torch

from mstar.model.pi05.checkpoint import Pi05Checkpoint, read_embodiment
from mstar.model.weights import WeightLoadError
from tests.support.pi05 import ACTION_STATS, STATE_STATS, reference_model, write_checkpoint

pytest.importorskip("transformers.models.pi05")


@pytest.fixture(scope="module")
def reference():
    return reference_model(seed=3)


@pytest.mark.parametrize("prefix", ["", "model."])
def test_loads_released_layout(tmp_path, reference, prefix):
    write_checkpoint(tmp_path, reference, prefix=prefix)
    ckpt = Pi05Checkpoint.locate(str(tmp_path))
    config = ckpt.config()
    assert config.cameras == ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb")
    assert (config.state_dim, config.action_dim, config.chunk_size) == (4, 5, 5)
    model = ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 16, 16, generator=g) * 2 - 1
    ids = torch.randint(0, 90, (8,), generator=g)
    noise = torch.randn(1, 5, 6, generator=g)
    want = reference.sample_actions(torch.cat([torch.full((32,), 95), ids])[None], pixels[None], noise=noise.clone(),
                                    attention_mask=torch.ones(1, 40, dtype=torch.long),
                                    pixel_attention_mask=torch.ones(1, 2, dtype=torch.bool), num_steps=3)
    got = model.sample_actions([pixels], [ids], noise, page_size=4)
    assert float((got - want).abs().max()) < 1e-5
    embed = model.language_model.embed_tokens.weight
    assert torch.equal(embed, reference.model.vlm.language_model.embed_tokens.weight)


def test_coverage_both_ways(tmp_path, reference):
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path, reference)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    missing = "paligemma_with_expert.gemma_expert.model.layers.1.post_attention_layernorm.dense.bias"
    extra = "paligemma_with_expert.paligemma.model.language_model.layers.9.mlp.up_proj.weight"
    damaged = {k: v for k, v in tensors.items() if k != missing}
    damaged[extra] = torch.zeros(2)
    save_file(damaged, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError) as err:
        Pi05Checkpoint.locate(str(tmp_path)).load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    assert missing in str(err.value) and extra in str(err.value)


def test_dummy_weights_are_seeded(tmp_path):
    write_checkpoint(tmp_path)  # no weights at all
    ckpt = Pi05Checkpoint.locate(str(tmp_path))
    a = ckpt.load_model(torch.device("cpu"), torch.float32, dummy=True, seed=1)
    b = ckpt.load_model(torch.device("cpu"), torch.float32, dummy=True, seed=1)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert a.action_out_proj.weight.abs().sum() > 0


def test_normalisation_and_tokenizer(tmp_path):
    write_checkpoint(tmp_path)
    emb = read_embodiment(tmp_path)
    assert emb.state.mode == emb.action.mode == "QUANTILES"
    assert (emb.state.width, emb.action.width) == (4, 5)
    q01, q99 = torch.tensor(STATE_STATS["q01"]), torch.tensor(STATE_STATS["q99"])
    state = torch.tensor([0.0, 2.0, 1.0, 0.5])
    want = 2 * (state - q01) / torch.where(q99 == q01, torch.tensor(1e-8), q99 - q01) - 1
    assert torch.allclose(emb.state.normalize(state), want)
    actions = torch.rand(5, 5) * 2 - 1
    lo, hi = torch.tensor(ACTION_STATS["q01"]), torch.tensor(ACTION_STATS["q99"])
    assert torch.allclose(emb.action.unnormalize(actions), (actions + 1) * (hi - lo) / 2 + lo)
    assert torch.allclose(emb.action.normalize(emb.action.unnormalize(actions)), actions, atol=1e-6)
    tok = Pi05Checkpoint.locate(str(tmp_path)).tokenizer()
    ids = tok("Task: go, State: 1 2;\nAction: ").input_ids
    assert ids[0] == tok.bos_token_id and max(ids) < 95


def test_no_pipelines_means_identity(tmp_path):
    emb = read_embodiment(tmp_path)
    assert emb.state.mode == emb.action.mode == "IDENTITY"
