"""Cosmos3 checkpoints in the layout ``Cosmos3OmniPipeline`` saves: the tower folder loads into
ours with coverage checked both ways (a parameter left unfilled and a tensor nothing loads each
fail, named); the prompt ids equal the pipeline's; the native-schedule variant is refused by
name; ``load_format: dummy`` builds diffusers' default (Nano-sized) tower and an
Edge-style (relu2) tower at their shapes on the meta device."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mstar.config import parse_config
from mstar.model.cosmos3.checkpoint import Cosmos3Checkpoint
from mstar.model.cosmos3.engine import FP32_PARAMETERS
from mstar.model.cosmos3.transformer import Cosmos3Transformer
from mstar.model.wan22.vae import WanVAE
from mstar.model.weights import WeightLoadError, iter_safetensors, load_weights


def test_folders_load_with_full_coverage(checkpoint):
    ckpt = Cosmos3Checkpoint(checkpoint.root)
    for folder, module, reference in (("transformer", Cosmos3Transformer(ckpt.transformer_config()),
                                       checkpoint.transformer),
                                      ("vae", WanVAE(ckpt.vae_config()), checkpoint.vae)):
        load_weights(module, iter_safetensors(checkpoint.root / folder))
        ours = module.state_dict()
        for name, tensor in reference.state_dict().items():
            assert torch.equal(ours[name], tensor), name


def test_coverage_is_checked_both_ways(checkpoint):
    tensors = load_file(checkpoint.root / "transformer" / "diffusion_pytorch_model.safetensors")
    tower = Cosmos3Transformer(Cosmos3Checkpoint(checkpoint.root).transformer_config())
    missing = {k: v for k, v in tensors.items() if k != "layers.1.mlp_moe_gen.up_proj.weight"}
    with pytest.raises(WeightLoadError, match="did not fill.*layers.1.mlp_moe_gen.up_proj"):
        load_weights(tower, missing.items())
    extra = {**tensors, "audio_proj_in.weight": torch.zeros(32, 5)}
    with pytest.raises(WeightLoadError, match="nothing loads.*audio_proj_in"):
        load_weights(tower, extra.items())


@pytest.mark.parametrize("frames, negative", [(1, False), (9, True)])
def test_prompt_ids_equal_the_pipeline(checkpoint, frames, negative):
    prompt = Cosmos3Checkpoint(checkpoint.root).prompt()
    text = "" if negative else "a cat walks on the moon."
    cond, uncond = checkpoint.pipeline().tokenize_prompt(text if not negative else "x", text, num_frames=frames,
                                                         height=48, width=32, fps=16.0)
    got = prompt.ids(text, num_frames=frames, height=48, width=32, fps=16.0, negative=negative)
    assert got.tolist() == (uncond if negative else cond)


@pytest.mark.parametrize("files, message", [
    ({"model_index.json": {"use_native_flow_schedule": True}}, "use_native_flow_schedule"),
])
def test_unserved_variants_are_refused(checkpoint, tmp_path, files, message):
    index = json.loads((checkpoint.root / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    for name, data in files.items():
        base = index if name == "model_index.json" else {}
        (tmp_path / name).write_text(json.dumps({**base, **data}))
    with pytest.raises(ValueError, match=message):
        Cosmos3Checkpoint(tmp_path).check_variant()


EDGE_LIKE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, rope_axes_dim=[12, 10, 10], hidden_act="relu2",
                 qk_norm_for_text=False, use_und_k_norm_for_gen=True, vocab_size=1000)


@pytest.mark.parametrize("config", [{}, EDGE_LIKE], ids=["diffusers_defaults", "edge_like"])
def test_dummy_weights_at_real_shapes_on_meta(tmp_path, config):
    from diffusers import Cosmos3OmniTransformer

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "Cosmos3OmniTransformer",
                                                                      **config}))
    ckpt = Cosmos3Checkpoint(tmp_path)
    deploy = parse_config({"model": "cosmos3", "model_path": str(tmp_path), "load_format": "dummy"})
    ours = ckpt.loader(deploy, 0, torch.device("meta"))(lambda: Cosmos3Transformer(ckpt.transformer_config()),
                                                         "transformer", 0, fp32=FP32_PARAMETERS)
    with torch.device("meta"):
        theirs = Cosmos3OmniTransformer(**config)
    assert all(p.is_meta for p in ours.parameters())
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    billions = sum(p.numel() for p in ours.parameters()) / 1e9
    print(f"[shapes] tower {billions:.2f}B parameters")


def test_bf16_keeps_the_time_embedder_fp32(checkpoint):
    """In a bfloat16 deployment the time MLP stays float32 (diffusers' ``_keep_in_fp32_modules``)
    and the tower's bf16 velocity follows diffusers' bf16 model on the same weights."""
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from test_cosmos3_transformer_parity import item, ref_forward

    ckpt = Cosmos3Checkpoint(checkpoint.root)
    config = parse_config({"model": "cosmos3", "model_path": str(checkpoint.root), "dtype": "bfloat16"})
    tower = ckpt.loader(config, 0, torch.device("cpu"))(lambda: Cosmos3Transformer(ckpt.transformer_config()),
                                                        "transformer", 0, fp32=FP32_PARAMETERS)
    kept = {name for name, p in tower.named_parameters() if p.dtype == torch.float32}
    assert kept == {name for name, _ in tower.named_parameters() if name.startswith("time_embedder.")}
    ref = copy.deepcopy(checkpoint.transformer).to(torch.bfloat16)
    ref.time_embedder.float().load_state_dict(checkpoint.transformer.time_embedder.state_dict())
    gen = torch.Generator().manual_seed(4)
    latents, ids = torch.randn((4, 3, 4, 4), generator=gen), torch.randint(0, 200, (12,), generator=gen)
    with torch.no_grad():
        want = ref_forward(ref, ids, latents.bfloat16(), 640.0, [0, 1, 2], 24.0).float()
        got = tower([item(tower, ids, latents, 640.0, [0, 1, 2], 24.0)])[0].float()
    err = float((got - want).abs().max() / want.abs().max())
    print(f"[bf16] tower velocity rel err vs diffusers bf16 {err:.2e}")
    assert err < 2e-2
