"""GLM-5.2's checkpoint: fp8 block dequantisation equal to transformers', the released key
layout (fp8 weights with ``weight_scale_inv``, the MTP layer) loaded with coverage both ways,
dummy weights, and the error for weights that are not there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

from mstar.model.glm52.checkpoint import Glm52Checkpoint
from mstar.model.glm52.fp8 import dequantize_block_fp8, dequantized
from mstar.model.weights import ModelPathError, WeightLoadError
from tests.support.glm52 import released_tensors, tiny_reference

BLOCK = (16, 16)


def quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 weight, scale_inv)`` per block (amax / 448), partial edge blocks included."""
    rows, cols = weight.shape
    bm, bn = block
    grid = (-(-rows // bm), -(-cols // bn))
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            scale[i, j] = weight[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].abs().max().clamp_min(1e-12) / 448
    full = scale.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    return (weight / full).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_transformers(dtype: torch.dtype) -> None:
    """Whole blocks: equal to transformers' load-time ``Fp8Dequantize`` bit for bit; with a
    partial edge block (576 rows in 128-blocks, as kv_a_proj_with_mqa): to its per-block
    ``_dequantize_fp8_weight`` in float32."""
    gen = torch.Generator().manual_seed(0)
    weight, scale = quantize(torch.randn(64, 96, generator=gen), (32, 32))
    ours = dequantize_block_fp8(weight, scale, (32, 32), dtype)
    ref = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=dtype)
    assert torch.equal(ours, ref)
    weight, scale = quantize(torch.randn(576, 200, generator=gen), (128, 128))
    assert scale.shape == (5, 2)
    ours = dequantize_block_fp8(weight, scale, (128, 128), torch.float32)
    assert torch.equal(ours, _dequantize_fp8_weight(weight.clone(), scale, [128, 128], torch.float32))
    with pytest.raises(ValueError, match="scale grid"):
        dequantize_block_fp8(weight, scale[:4], (128, 128))


def test_unpaired_fp8_weight_is_named() -> None:
    weight, scale = quantize(torch.randn(16, 16))
    with pytest.raises(WeightLoadError, match=r"a\.weight \(no a\.weight_scale_inv\)"):
        list(dequantized([("a.weight", weight)], torch.float32, BLOCK))
    pairs = list(dequantized([("a.weight_scale_inv", scale), ("b.bias", torch.ones(2)), ("a.weight", weight)],
                             torch.float32, BLOCK))
    assert [n for n, _ in pairs] == ["b.bias", "a.weight"]


def write_release(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A released-layout directory: every projection matrix as e4m3 plus its block scales,
    norms, router, embeddings and head unquantised, two shards; returns the weights the fp8
    pairs stand for (dequantised by transformers' per-block function: some tiny shapes end in
    a partial block)."""
    stored, meant = {}, {}
    for name, tensor in tensors.items():
        quantizable = tensor.dim() == 2 and ("proj" in name or name.endswith(("wk.weight", "wq_b.weight")))
        if quantizable and "embed" not in name and "mlp.gate." not in name:
            weight, scale = quantize(tensor)
            stored[name], stored[name + "_scale_inv"] = weight, scale
            meant[name] = _dequantize_fp8_weight(weight.clone(), scale, list(BLOCK), torch.float32)
        else:
            stored[name] = meant[name] = tensor
    names = sorted(stored)
    half = len(names) // 2
    save_file({n: stored[n].contiguous() for n in names[:half]}, directory / "model-00001-of-00002.safetensors")
    save_file({n: stored[n].contiguous() for n in names[half:]}, directory / "model-00002-of-00002.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return meant


def release_config(ref) -> dict:
    config = ref.config.to_dict()
    config.update(num_nextn_predict_layers=1, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)})
    return config


def mtp_tensors(ref, layer: int) -> dict[str, torch.Tensor]:
    """The MTP layer's keys as released (a decoder layer plus its own norms and projection)."""
    hidden = ref.config.hidden_size
    out = {f"model.layers.{layer}.{k[len('model.layers.2.'):]}": v.clone()
           for k, v in released_tensors(ref).items() if k.startswith("model.layers.2.")}
    out.update({f"model.layers.{layer}.enorm.weight": torch.ones(hidden),
                f"model.layers.{layer}.hnorm.weight": torch.ones(hidden),
                f"model.layers.{layer}.eh_proj.weight": torch.randn(hidden, 2 * hidden),
                f"model.layers.{layer}.shared_head.norm.weight": torch.ones(hidden)})
    return out


def test_release_layout_loads_with_fp8_and_mtp_skipped(tmp_path: Path) -> None:
    """Every parameter equals the dequantised weight it came from; the MTP layer
    (``model.layers.3.*``, fp8 included) is read and skipped."""
    ref = tiny_reference(seed=7)
    tensors = {**released_tensors(ref), **mtp_tensors(ref, ref.config.num_hidden_layers)}
    meant = write_release(tmp_path, tensors, release_config(ref))
    assert meant["model.layers.3.self_attn.q_a_proj.weight"].dtype == torch.float32  # an fp8 MTP weight
    ckpt = Glm52Checkpoint.locate(str(tmp_path))
    assert ckpt.fp8_block() == BLOCK
    model = ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    stacked = {"experts.gate_up.weight", "experts.down.weight", "gate_up_proj.weight"}
    checked = 0
    for name, param in model.named_parameters():
        if any(name.endswith(s) for s in stacked):
            continue
        assert torch.equal(param, meant[name]), name
        checked += 1
    layer = model.model.layers[1]
    gate = torch.cat([meant["model.layers.1.mlp.experts.5.gate_proj.weight"],
                      meant["model.layers.1.mlp.experts.5.up_proj.weight"]])
    assert torch.equal(layer.mlp.experts.gate_up.weight[5], gate)
    assert torch.equal(layer.mlp.experts.down.weight[2], meant["model.layers.1.mlp.experts.2.down_proj.weight"])
    assert checked > 30
    assert layer.mlp.gate.weight.dtype == torch.float32


def test_coverage_names_missing_and_extra_keys(tmp_path: Path) -> None:
    """A tensor the model needs, absent; one nothing loads (including a second MTP layer the
    config does not declare): each named."""
    ref = tiny_reference(seed=8)
    tensors = released_tensors(ref)
    tensors.pop("model.layers.2.self_attn.indexer.wk.weight")
    tensors["model.layers.4.enorm.weight"] = torch.ones(ref.config.hidden_size)
    write_release(tmp_path, tensors, release_config(ref))
    with pytest.raises(WeightLoadError) as err:
        Glm52Checkpoint.locate(str(tmp_path)).load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    assert "model.layers.2.self_attn.indexer.wk.weight" in str(err.value)
    assert "model.layers.4.enorm.weight" in str(err.value)


def test_dummy_weights_and_absent_weights(tmp_path: Path) -> None:
    ref = tiny_reference(seed=9)
    (tmp_path / "config.json").write_text(json.dumps(release_config(ref)))
    model = Glm52Checkpoint.locate(str(tmp_path)).load_model(torch.device("cpu"), torch.bfloat16, dummy=True, seed=0)
    assert model.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.q_a_proj.weight.std() > 0
    with pytest.raises(ModelPathError, match="model_path 'nobody/GLM-5.2-absent'.*never downloaded"):
        Glm52Checkpoint.locate("nobody/GLM-5.2-absent", cache_dir=str(tmp_path / "hub"))


def test_real_shapes_match_the_reference() -> None:
    """At the released shapes (transformers' defaults, GLM-5's 78 layers), built on the meta
    device: every parameter the reference has, in the same number (ours stacks the experts and
    fuses gate/up; the counts are the same)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from mstar.model.glm52 import Glm52Config, Glm52ForCausalLM

    hf_config = GlmMoeDsaConfig()
    with torch.device("meta"):
        ref = GlmMoeDsaForCausalLM(hf_config)
        ours = Glm52ForCausalLM(Glm52Config.from_dict(hf_config.to_dict()))
    count = sum(p.numel() for p in ours.parameters())
    ref_count = sum(p.numel() for p in ref.parameters()) + sum(
        b.numel() for n, b in ref.named_buffers() if n.endswith("e_score_correction_bias"))
    assert count == ref_count
    assert ours.cache_shape() == (78, 1, 512 + 64 + 128, 1)
