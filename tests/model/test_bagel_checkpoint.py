"""BAGEL's checkpoint: a tiny random model written in the hub snapshot's layout (``ema.safetensors``
with the official key names, the three config files, the tokenizer) loads into our parts with
coverage both ways; the generation side's tensors go to the module it hands in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mstar.model.bagel.checkpoint import FIXED_TABLES, PART_PREFIXES, BagelCheckpoint, load_parts
from mstar.model.bagel.vision import sincos_table
from mstar.model.weights import WeightLoadError
from tests.support.bagel_reference import LLM, TOKENS, VIT, reference_bagel, write_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def ref():
    return reference_bagel(seed=4)


@pytest.fixture(scope="module")
def checkpoint_dir(ref, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bagel"), ref)


def generation_part(ref) -> nn.Module:
    """The generation side's module, holding ``ref``'s weights."""
    from mstar.model.bagel.generation import LatentProjections

    cfg = ref.config
    part = LatentProjections(cfg.llm_config.hidden_size, cfg.vae_config.z_channels, cfg.latent_patch_size,
                             cfg.max_latent_size)
    part.load_state_dict({k: v for k, v in ref.state_dict().items()
                          if k.startswith(PART_PREFIXES["generation"]) and k not in FIXED_TABLES})
    return part


def test_config_and_tokenizer(checkpoint_dir):
    ckpt = BagelCheckpoint.locate(str(checkpoint_dir))
    config = ckpt.config()
    assert config.vision.num_hidden_layers == VIT["num_hidden_layers"]  # the file says one more
    assert (config.llm.hidden_size, config.llm.num_key_value_heads, config.llm.head_dim) == (64, 2, 16)
    assert config.vit_max_num_patch_per_side == 8 and config.max_latent_size == 8
    tokens = ckpt.special_tokens(ckpt.tokenizer())
    assert (tokens.im_start, tokens.im_end, tokens.vision_start, tokens.vision_end) == (
        TOKENS["bos_token_id"], TOKENS["eos_token_id"], TOKENS["start_of_image"], TOKENS["end_of_image"])


def test_loads_every_tensor_of_its_parts(ref, checkpoint_dir):
    llm, vision = BagelCheckpoint.locate(str(checkpoint_dir)).load_models(
        torch.device("cpu"), torch.float32, llm=True, vision=True, dummy=False, seed=0)
    expected = ref.state_dict()
    for name, tensor in llm.state_dict().items():
        assert torch.equal(tensor, expected["language_model." + name]), name
    for name, tensor in vision.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert len(llm.state_dict()) + len(vision.state_dict()) + 1 == sum(  # + vit_pos_embed, fixed
        1 for k in expected if k.startswith(PART_PREFIXES["llm"] + PART_PREFIXES["vision"]))
    assert torch.equal(vision.vit_pos_embed.pos_embed, expected["vit_pos_embed.pos_embed"])


def test_fixed_table_may_be_absent(ref, tmp_path):
    tensors = {k: v for k, v in ref.state_dict().items() if k not in FIXED_TABLES}
    ckpt = BagelCheckpoint.locate(str(write_checkpoint(tmp_path, ref, tensors)))
    _, vision = ckpt.load_models(torch.device("cpu"), torch.float32, llm=False, vision=True, dummy=False, seed=0)
    assert torch.equal(vision.vit_pos_embed.pos_embed, ref.vit_pos_embed.pos_embed)


def test_generation_part_hook(ref, checkpoint_dir):
    """All three parts together take every tensor of ``ema.safetensors``."""
    ckpt = BagelCheckpoint.locate(str(checkpoint_dir))
    config = ckpt.config()
    from mstar.model.bagel.llm import BagelLanguageModel
    from mstar.model.bagel.vision import BagelVision

    generation = generation_part(reference_bagel(seed=9))
    load_parts({"llm": BagelLanguageModel(config.llm), "vision": BagelVision(config), "generation": generation},
               ckpt.tensors())
    assert torch.equal(generation.vae2llm.weight, ref.vae2llm.weight)
    assert torch.equal(generation.latent_pos_embed.pos_embed, ref.latent_pos_embed.pos_embed)


def test_one_part_skips_the_others(ref, checkpoint_dir):
    llm, vision = BagelCheckpoint.locate(str(checkpoint_dir)).load_models(
        torch.device("cpu"), torch.float32, llm=False, vision=True, dummy=False, seed=0)
    assert llm is None
    assert torch.equal(vision.connector.fc2.bias, ref.connector.fc2.bias)


@pytest.mark.parametrize("change, named", [
    ("drop", "language_model.model.layers.1.self_attn.k_norm_moe_gen.weight"),
    ("extra", "vit_model.vision_model.head.weight"),
    ("stranger", "mystery.weight"),
])
def test_coverage_both_ways(ref, tmp_path, change, named):
    tensors = dict(ref.state_dict())
    if change == "drop":
        del tensors[named]
    else:
        tensors[named] = torch.zeros(2)
    ckpt = BagelCheckpoint.locate(str(write_checkpoint(tmp_path, ref, tensors)))
    with pytest.raises(WeightLoadError, match=named.replace(".", r"\.")):
        ckpt.load_models(torch.device("cpu"), torch.float32, llm=True, vision=True, dummy=False, seed=0)


def test_dummy_weights_real_shapes(tmp_path, checkpoint_dir):
    for name in ("llm_config.json", "vit_config.json", "config.json"):
        (tmp_path / name).write_text((checkpoint_dir / name).read_text())
    llm, vision = BagelCheckpoint.locate(str(tmp_path)).load_models(  # no ema.safetensors needed
        torch.device("cpu"), torch.float32, llm=True, vision=True, dummy=True, seed=1)
    assert llm.model.layers[1].self_attn.q_proj_moe_gen.weight.shape == (64, 64)
    assert llm.lm_head.weight.shape == (LLM["vocab_size"], 64)
    assert float(llm.lm_head.weight.std()) > 0
    assert torch.equal(vision.vit_pos_embed.pos_embed, sincos_table(8, 64))
    with pytest.raises(FileNotFoundError, match="ema.safetensors"):
        BagelCheckpoint.locate(str(tmp_path)).load_models(torch.device("cpu"), torch.float32, llm=True,
                                                          vision=False, dummy=False, seed=0)


def test_not_a_bagel_directory(tmp_path):
    with pytest.raises(ValueError, match="llm_config.json"):
        BagelCheckpoint.locate(str(tmp_path))
