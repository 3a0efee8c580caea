"""LingBot-World's checkpoint: a tiny release written in the reference's key layout (DiT
safetensors shards with ``model.safetensors.index.json`` and a reference ``config.json`` at the
root of a hub-cache-like snapshot), loaded
with coverage checked both ways; the renaming agrees with diffusers' own single-file converter
for the Wan parts; dummy weights fill every parameter."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import save_file

from mstar.model.lingbot.checkpoint import LingbotCheckpoint, dit_name
from mstar.model.lingbot.config import LingbotConfig
from mstar.model.lingbot.transformer import LingbotTransformer
from mstar.model.wan22.config import WanTransformerConfig
from mstar.model.weights import WeightLoadError
from tests.support.diffusers_dirs import randomize

REFERENCE_CONFIG = dict(model_type="i2v", patch_size=[1, 2, 2], text_len=512, in_dim=12, dim=24, ffn_dim=40,
                        freq_dim=32, text_dim=16, out_dim=4, num_heads=2, num_layers=2, local_attn_size=4,
                        sink_size=0, qk_norm=True, cross_attn_norm=True, eps=1e-6)
BASE = LingbotConfig(dit=WanTransformerConfig(in_channels=12, out_channels=4, num_attention_heads=2,
                                              attention_head_dim=12, rope_max_seq_len=64, text_dim=16,
                                              freq_dim=32, ffn_dim=40, num_layers=2),
                     vae_stride=(4, 2, 2), chunk_frames=2)

# Our names -> the reference's (written out independently of dit_name, checked against diffusers)
TO_REFERENCE = [(".attn1.to_out.0.", ".self_attn.o."), (".attn2.to_out.0.", ".cross_attn.o."),
                (".attn1.to_", ".self_attn."), (".attn2.to_", ".cross_attn."), (".attn1.", ".self_attn."),
                (".attn2.", ".cross_attn."), (".norm2.", ".norm3."), (".ffn.net.0.proj.", ".ffn.0."),
                (".ffn.net.2.", ".ffn.2."), ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
                ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
                ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
                ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
                ("condition_embedder.time_proj.", "time_projection.1."), ("proj_out.", "head.head."),
                ("camera_embedder.", "")]


def reference_name(name: str) -> str:
    if name == "scale_shift_table":
        return "head.modulation"
    if name.endswith(".scale_shift_table"):
        return name.replace(".scale_shift_table", ".modulation")
    dotted = f".{name}"
    for ours, ref in TO_REFERENCE:
        dotted = dotted.replace(ours if ours.startswith(".") else f".{ours}", ref if ref.startswith(".") else f".{ref}")
    return dotted.lstrip(".")

@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A snapshot directory laid out like the hub cache's, and the model its tensors came from."""
    config = LingbotConfig(**{**BASE.__dict__, "window_frames": 4})
    model = LingbotTransformer(config).eval()
    randomize(model, 0, spread=0.3, weight_gain=1.5)
    root = tmp_path_factory.mktemp("hub") / "models--robbyant--lingbot-world-v2-1.3b-causal-fast" / "snapshots" / "0f"
    root.mkdir(parents=True)
    tensors = {reference_name(k): v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(tensors)  # sharded with an index, as the release is (model-0000k-of-0000n)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, root / file)
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps(REFERENCE_CONFIG))
    return root, model, tensors


def test_reference_names_follow_the_diffusers_converter(release):
    _, model, tensors = release
    wan = {k: v for k, v in tensors.items() if "cam" not in k and "c2ws" not in k}
    converted = convert_wan_transformer_to_diffusers(dict(wan))
    assert set(converted) == {k for k in model.state_dict() if "cam" not in k and "c2ws" not in k}
    assert all(dit_name(k) == diffusers for k, diffusers in zip(wan, convert_wan_transformer_to_diffusers(
        {k: torch.empty(0) for k in wan})))
    assert "blocks.0.self_attn.q.weight" in tensors and "blocks.1.norm3.weight" in tensors
    assert "blocks.0.cam_scale_layer.weight" in tensors and "patch_embedding_wancamctrl.weight" in tensors


def test_release_loads_with_full_coverage(release):
    root, model, _ = release
    ckpt = LingbotCheckpoint(root, assets=None)  # type: ignore[arg-type]
    config = ckpt.config(BASE)
    assert config.window_frames == 4 and config.dit.dim == 24 and config.dit.in_channels == 12
    loaded = ckpt.load_dit(config, device=torch.device("cpu"), dtype=torch.float32, dummy=False, seed=0)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    gen = torch.Generator().manual_seed(1)
    x, text = torch.randn(1, 12, 2, 4, 6, generator=gen), torch.randn(1, 5, 16, generator=gen)
    camera = torch.randn(1, config.camera_channels, 2, 4, 6, generator=gen)
    with torch.no_grad():
        t = torch.tensor([500.0])
        assert torch.equal(loaded(x, t, text, camera), model(x, t, text, camera))


@pytest.mark.parametrize("change", ["extra", "missing"])
def test_coverage_is_checked_both_ways(release, tmp_path, change):
    _, _, tensors = release
    tensors = dict(tensors)
    if change == "extra":
        tensors["blocks.0.cam_bogus.weight"] = torch.zeros(2)
    else:
        del tensors["blocks.1.cam_shift_layer.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match="cam_bogus" if change == "extra" else "blocks.1.cam_shift_layer.bias"):
        LingbotCheckpoint(tmp_path, assets=None).load_dit(BASE, device=torch.device("cpu"),  # type: ignore[arg-type]
                                                          dtype=torch.float32, dummy=False, seed=0)


def test_dummy_weights_fill_everything(tmp_path):
    a = LingbotCheckpoint(tmp_path, assets=None).load_dit(BASE, device=torch.device("cpu"),  # type: ignore[arg-type]
                                                          dtype=torch.bfloat16, dummy=True, seed=3)
    b = LingbotCheckpoint(tmp_path, assets=None).load_dit(BASE, device=torch.device("cpu"),  # type: ignore[arg-type]
                                                          dtype=torch.bfloat16, dummy=True, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.scale_shift_table.dtype == torch.float32 and a.proj_out.weight.dtype == torch.bfloat16
    assert all(p.abs().sum() > 0 for n, p in a.named_parameters() if n.endswith("weight"))
