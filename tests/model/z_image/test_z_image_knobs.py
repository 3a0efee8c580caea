"""Z-Image-Turbo deployment knobs: lora (folded into the DiT at load, in diffusers/PEFT, kohya and
dotted layouts), compile (against eager) and the startup checks that name the key. Uses the tiny
checkpoint of conftest.py.

peft is not installed here, so diffusers' ``load_lora_weights`` + ``fuse_lora`` cannot run; the
served DiT is checked against diffusers' transformer with the adapter merged by hand
(``W + scale * alpha / r * B @ A``), and the other layouts against diffusers' own Z-Image key
converter (``_convert_non_diffusers_z_image_lora_to_diffusers``) folded by module name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mstar.config import parse_config
from mstar.engine.base import EngineItem
from mstar.model.lora import LoraAdapter, fold_adapters
from mstar.model.registry import model_class
from mstar.model.z_image.config import ZImageTransformerConfig
from mstar.model.z_image.knobs import ZImageKnobs
from mstar.model.z_image.lora_layout import fold_z_image_adapters
from mstar.model.z_image.transformer import ZImageTransformer

RANK = 4
# module -> (out, in) on the tiny DiT (dim 32, ffn 85, adaln 32, 2x2 patches of 4 channels, captions 24)
TARGETS = {"layers.0.attention.to_q": (32, 32), "layers.1.feed_forward.w2": (32, 85),
           "noise_refiner.0.adaLN_modulation.0": (128, 32), "context_refiner.0.attention.to_out.0": (32, 32),
           "all_final_layer.2-1.linear": (16, 32), "all_x_embedder.2-1": (32, 16), "cap_embedder.1": (32, 24),
           "t_embedder.mlp.2": (32, 1024)}


def build_dit(root, **kwargs):
    spec = model_class("z_image_turbo")(parse_config({"model": "z_image_turbo", "model_path": str(root),
                                                      "model_kwargs": kwargs}))
    return spec.build_engines({"dit"}, torch.device("cpu"))["dit"]


def step_items(captions=(7, 40), seed=0):
    """Denoise steps of requests at one size (latents [4, 8, 12]) with captions of these lengths."""
    g = torch.Generator().manual_seed(seed)
    return [EngineItem(f"r{i}", "step", 0, {"latents": torch.randn(4, 8, 12, generator=g),
                                           "text": torch.randn(48, 24, generator=g)},
                       {"num_steps": 2, "image_seq_len": 24, "caption_len": n})
            for i, n in enumerate(captions)]


def lora_pair(out, inp, g):
    return torch.randn(RANK, inp, generator=g) * 0.3, torch.randn(out, RANK, generator=g) * 0.3


def test_lora_is_folded_into_the_served_dit(checkpoint, tmp_path):
    """The served DiT with a PEFT-format adapter (alpha keys, ``transformer.`` prefix) equals
    diffusers' transformer whose weights were merged by hand."""
    from diffusers import ZImageTransformer2DModel

    g = torch.Generator().manual_seed(11)
    tensors, merged = {}, {k: v.clone() for k, v in checkpoint.transformer.state_dict().items()}
    for name, (out, inp) in TARGETS.items():
        a, b = lora_pair(out, inp, g)
        tensors[f"transformer.{name}.lora_A.weight"], tensors[f"transformer.{name}.lora_B.weight"] = a, b
        tensors[f"transformer.{name}.alpha"] = torch.tensor(8.0)
        merged[f"{name}.weight"] += 0.75 * 8.0 / RANK * (b @ a)
    save_file(tensors, tmp_path / "style.safetensors")
    engine = build_dit(checkpoint.root, lora=[{"path": str(tmp_path / "style.safetensors"), "scale": 0.75}])
    want_model = ZImageTransformer2DModel.from_config(checkpoint.transformer.config).eval()
    want_model.load_state_dict(merged)

    items = step_items()
    latents = torch.stack([i.inputs["latents"] for i in items])
    text = torch.stack([i.inputs["text"] for i in items])
    t = torch.tensor([0.3, 0.8])
    params = [i.params for i in items]
    with torch.no_grad():
        captions = [row[: p["caption_len"]] for row, p in zip(text, params)]
        want = -torch.stack(want_model(list(latents.unsqueeze(2)), t, captions, return_dict=False)[0]).squeeze(2)
        ours = engine.velocity(latents, text, t, params)
        plain = build_dit(checkpoint.root).velocity(latents, text, t, params)
    assert (ours - want).norm() / want.norm() <= 1e-5
    assert (plain - want).norm() / want.norm() > 1e-3  # the adapter does change the output


def original_layout_adapter(g, dotted: bool) -> dict[str, torch.Tensor]:
    """An adapter as other Z-Image trainers write it: kohya names (``lora_unet_`` + the path with
    underscores, ``lora_down``/``lora_up``), or dotted names (``to.q``, ``lora.down``/``lora.up``)
    with the fused ``qkv`` / bare ``out`` duplicates of the split projections of block 0; block 1
    has a fused ``qkv`` and an ``out`` only. Modules carry alphas (kohya: each its own; dotted:
    those diffusers reads, a duplicate sharing its original's)."""
    modules = {"layers.0.attention.to.q": (32, 32), "layers.0.attention.to.k": (32, 32),
               "layers.0.attention.to.v": (32, 32), "layers.0.attention.to_out.0": (32, 32),
               "layers.0.attention.qkv": (96, 32), "layers.0.attention.out": (32, 32),
               "layers.1.attention.qkv": (96, 32), "layers.1.attention.out": (32, 32),
               "noise_refiner.0.feed_forward.w1": (85, 32), "context_refiner.0.attention.to.v": (32, 32),
               "noise_refiner.0.adaLN_modulation.0": (128, 32), "cap_embedder.1": (32, 24),
               "t_embedder.mlp.0": (1024, 256), "all_final_layer.2-1.adaLN_modulation.1": (32, 32)}
    tensors = {}
    for i, (name, (out, inp)) in enumerate(modules.items()):
        a, b = lora_pair(out, inp, g)
        if dotted:
            key, down, up = name, "lora.down", "lora.up"
        else:
            key, down, up = "lora_unet_" + name.replace(".", "_"), "lora_down", "lora_up"
        tensors[f"{key}.{down}.weight"], tensors[f"{key}.{up}.weight"] = a, b
        if not dotted:
            tensors[f"{key}.alpha"] = torch.tensor(float(2 + i % 5))
        elif ".to." not in name:
            tensors[f"{key}.alpha"] = torch.tensor(5.0 if name.startswith("layers.0.attention") else float(2 + i % 5))
    if not dotted:  # kohya files hold split projections only: drop block 0's fused duplicates
        tensors = {k: v for k, v in tensors.items()
                   if not k.startswith(("lora_unet_layers_0_attention_qkv.", "lora_unet_layers_0_attention_out."))}
    return tensors


@pytest.mark.parametrize("dotted", [False, True], ids=["kohya", "dotted"])
def test_other_layouts_land_where_diffusers_converts_them(checkpoint, tmp_path, dotted):
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_z_image_lora_to_diffusers,
    )

    tensors = original_layout_adapter(torch.Generator().manual_seed(5), dotted)
    converted = _convert_non_diffusers_z_image_lora_to_diffusers(dict(tensors))  # alphas baked in
    save_file(tensors, tmp_path / "theirs_layout.safetensors")
    save_file(converted, tmp_path / "converted.safetensors")
    torch.manual_seed(0)
    config = ZImageTransformerConfig.from_dict(dict(checkpoint.transformer.config))
    ours, theirs = (ZImageTransformer(config) for _ in range(2))
    theirs.load_state_dict(ours.state_dict())
    base = {n: p.detach().clone() for n, p in ours.named_parameters()}
    fold_z_image_adapters(ours, [LoraAdapter(str(tmp_path / "theirs_layout.safetensors"), 0.6)])
    fold_adapters(theirs, [LoraAdapter(str(tmp_path / "converted.safetensors"), 0.6)])  # by module name
    changed = {n for n, p in ours.named_parameters() if not torch.equal(p, base[n])}
    assert len(changed) == 14  # 4 + 4 attention projections of layers 0 and 1, and 6 single modules
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), name


def test_compile_switch_matches_eager(checkpoint):
    """compile: true compiles the DiT blocks (inductor by default; this CPU test traces with the
    aot_eager backend, since inductor's C++ build takes minutes on the shared CI CPU). Two
    batches of different caption lengths, then one row alone, all through the compiled blocks."""
    eager = build_dit(checkpoint.root)
    compiled = build_dit(checkpoint.root, compile=True, compile_backend="aot_eager")
    for batch in (step_items((7, 40)), step_items((33, 5), seed=1), step_items((12,), seed=2)):
        want, got = eager.run(batch), compiled.run(batch)
        for w, g in zip(want, got):
            assert torch.allclose(g.outputs["latents"], w.outputs["latents"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kwargs, key", [
    ({"compile": "yes"}, "model_kwargs.compile"),
    ({"compile": True, "compile_backend": "no_such_backend"}, "model_kwargs.compile_backend"),
    ({"compile_backend": 3}, "model_kwargs.compile_backend"),
    ({"lora": [{"scale": 2}]}, r"model_kwargs.lora\[0\]"),
    ({"lora": [{"path": "a.safetensors", "scale": "strong"}]}, r"model_kwargs.lora\[0\].scale"),
    ({"lora": 5}, "model_kwargs.lora"),
    ({"max_batch_size": 0}, "model_kwargs.max_batch_size"),
])
def test_bad_knobs_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        ZImageKnobs.parse(kwargs)


def test_bad_adapters_fail_at_load_naming_the_key(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"model_kwargs.lora\[0\]: .*neither a file nor a folder"):
        build_dit(checkpoint.root, lora=[{"path": "/nonexistent/style.safetensors"}])
    g = torch.Generator().manual_seed(2)
    (a, b), (c, d) = lora_pair(32, 32, g), lora_pair(32, 32, g)
    save_file({"layers.0.attention.to_q.lora_A.weight": a, "layers.0.attention.to_q.lora_B.weight": b},
              tmp_path / "good.safetensors")
    save_file({"layers.0.attention.to_z.lora_A.weight": c, "layers.0.attention.to_z.lora_B.weight": d},
              tmp_path / "stray.safetensors")
    with pytest.raises(ValueError, match=r"model_kwargs.lora\[1\]: .*no linear layer 'layers.0.attention.to_z'"):
        build_dit(checkpoint.root, lora=[{"path": str(tmp_path / "good.safetensors")},
                                         {"path": str(tmp_path / "stray.safetensors")}])
