"""LoRA folding (mstar.model.lora) with PEFT's scaling.

peft is not installed in this environment, so diffusers' ``load_lora_weights`` + ``fuse_lora``
cannot run here; the folded weights are checked against ``W + scale * alpha / r * B @ A``
computed by hand (``alpha / sqrt(r)`` for rsLoRA), and the BFL-layout renaming against
diffusers' own converter (``_convert_non_diffusers_flux2_lora_to_diffusers``)."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from mstar.model.flux2.lora_layout import flux2_lora_targets
from mstar.model.lora import (
    LoraAdapter,
    LoraError,
    fold_adapter,
    fold_adapters,
    parse_adapters,
    read_adapter,
)

RANK = 3


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"to_q": nn.Linear(6, 5), "to_out": nn.Linear(5, 6)})
                                    for _ in range(2))


def pair(out, inp, seed, rank=RANK):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, inp, generator=g), torch.randn(out, rank, generator=g)


def write(folder, tensors, config=None, name="pytorch_lora_weights.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / name)
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder / name


def adapter(prefix="transformer.", alpha=None):
    tensors = {}
    for i, (name, out, inp) in enumerate([("blocks.0.to_q", 5, 6), ("blocks.1.to_out", 6, 5)]):
        a, b = pair(out, inp, i)
        tensors[f"{prefix}{name}.lora_A.weight"], tensors[f"{prefix}{name}.lora_B.weight"] = a, b
        if alpha is not None:
            tensors[f"{prefix}{name}.alpha"] = torch.tensor(alpha)
    return tensors


def expected(model, tensors, prefix, factor):
    """Every targeted weight: W + factor * B @ A, in float32."""
    weights = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    for key, a in tensors.items():
        if key.endswith("lora_A.weight"):
            module = key[len(prefix):-len(".lora_A.weight")]
            b = tensors[key.replace("lora_A", "lora_B")]
            weights[f"{module}.weight"] += factor * (b @ a)
    return weights


@pytest.mark.parametrize("alpha_key, config, factor", [
    (6.0, None, 6.0 / RANK),  # an alpha tensor in the weights
    (None, {"r": RANK, "lora_alpha": 12}, 12 / RANK),  # PEFT's adapter_config.json
    (None, {"r": RANK, "lora_alpha": 12, "use_rslora": True}, 12 / RANK**0.5),  # rsLoRA
    (None, None, 1.0),  # no alpha anywhere: alpha = r
])
def test_fold_matches_peft_scaling(tmp_path, alpha_key, config, factor):
    torch.manual_seed(0)
    model = Tiny()
    tensors = adapter(alpha=alpha_key)
    write(tmp_path / "lora", tensors, config)
    want = expected(model, tensors, "transformer.", 0.5 * factor)
    fold_adapters(model, [LoraAdapter(str(tmp_path / "lora"), 0.5)])
    for name, p in model.named_parameters():
        assert torch.allclose(p, want[name], rtol=0, atol=1e-6), name


def test_alpha_pattern_and_peft_prefix(tmp_path):
    model = Tiny()
    tensors = adapter(prefix="base_model.model.")
    path = write(tmp_path / "peft", tensors, {"r": RANK, "lora_alpha": 3, "alpha_pattern": {"to_out": 9}},
                 name="adapter_model.safetensors")
    pairs = read_adapter(path)
    assert pairs["blocks.0.to_q"].scaling == pytest.approx(1.0)
    assert pairs["blocks.1.to_out"].scaling == pytest.approx(3.0)
    assert sorted(fold_adapter(model, pairs)) == ["blocks.0.to_q", "blocks.1.to_out"]


def test_fold_rounds_once_in_fp32(tmp_path):
    model = Tiny().to(torch.bfloat16)
    base = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    tensors = adapter()
    fold_adapters(model, [LoraAdapter(str(write(tmp_path / "l", tensors)), 0.01)])
    a, b = tensors["transformer.blocks.0.to_q.lora_A.weight"], tensors["transformer.blocks.0.to_q.lora_B.weight"]
    want = (base["blocks.0.to_q.weight"] + 0.01 * (b @ a)).to(torch.bfloat16)
    assert torch.equal(model.blocks[0]["to_q"].weight, want)


def test_bfl_layout_lands_where_diffusers_converts_it(tmp_path):
    """A LoRA in BFL's layout (fused qkv, linear1/linear2, img_mlp) folds into the same weights
    as its diffusers conversion folded by module name."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_flux2_lora_to_diffusers,
    )

    from mstar.model.flux2 import Flux2Transformer, Flux2TransformerConfig

    config = Flux2TransformerConfig.from_dict({
        "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 48, "timestep_guidance_channels": 32,
        "axes_dims_rope": (4, 4, 4, 4), "guidance_embeds": False})
    dim = 32
    shapes = {"double_blocks.0.img_attn.qkv": (3 * dim, dim), "double_blocks.0.txt_attn.qkv": (3 * dim, dim),
              "double_blocks.0.img_attn.proj": (dim, dim), "double_blocks.0.txt_mlp.2": (dim, 3 * dim),
              "double_blocks.0.img_mlp.0": (6 * dim, dim), "single_blocks.0.linear1": (9 * dim, dim),
              "single_blocks.0.linear2": (dim, 4 * dim), "final_layer.linear": (16, dim), "img_in": (dim, 16)}
    bfl = {}
    for i, (name, (out, inp)) in enumerate(shapes.items()):
        a, b = pair(out, inp, i, rank=4)
        bfl[f"diffusion_model.{name}.lora_A.weight"], bfl[f"diffusion_model.{name}.lora_B.weight"] = a, b
    converted = _convert_non_diffusers_flux2_lora_to_diffusers(dict(bfl))
    write(tmp_path / "bfl", bfl)
    write(tmp_path / "diffusers", converted)
    torch.manual_seed(0)
    ours, theirs = Flux2Transformer(config), Flux2Transformer(config)
    theirs.load_state_dict(ours.state_dict())
    base = {n: p.detach().clone() for n, p in ours.named_parameters()}
    fold_adapters(ours, [LoraAdapter(str(tmp_path / "bfl"), 0.7)], targets=flux2_lora_targets)
    fold_adapters(theirs, [LoraAdapter(str(tmp_path / "diffusers"), 0.7)])
    changed = [n for n, p in ours.named_parameters() if not torch.equal(p, base[n])]
    assert len(changed) == 13  # qkv x2 split into 3 each, plus 7 single targets
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), name


@pytest.mark.parametrize("value, rule", [
    (3, "must be a list"),
    ([{"scale": 1.0}], "lora[0]: must be a mapping with a 'path'"),
    ([{"path": "x", "scale": "big"}], "lora[0].scale: must be a finite number"),
    ([{"path": "x", "weight": 1}], "lora[0]: unknown keys ['weight']"),
])
def test_bad_adapter_lists_name_the_key(value, rule):
    with pytest.raises(LoraError, match="model_kwargs.lora") as err:
        parse_adapters(value)
    assert rule in str(err.value)


def test_bad_adapters_name_the_key_and_change_nothing(tmp_path):
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tensors = adapter()
    tensors["transformer.blocks.0.missing.lora_A.weight"] = torch.zeros(RANK, 6)
    tensors["transformer.blocks.0.missing.lora_B.weight"] = torch.zeros(5, RANK)
    with pytest.raises(LoraError, match=r"model_kwargs.lora\[0\]: .*no linear layer 'blocks.0.missing'"):
        fold_adapters(model, [LoraAdapter(str(write(tmp_path / "a", tensors)), 1.0)])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    dora = adapter()
    dora["transformer.blocks.0.to_q.lora_magnitude_vector"] = torch.ones(5)
    with pytest.raises(LoraError, match="not a LoRA A/B weight"):
        read_adapter(write(tmp_path / "b", dora))
    with pytest.raises(LoraError, match="neither a file"):
        read_adapter(str(tmp_path / "nowhere" / "x.safetensors"))
