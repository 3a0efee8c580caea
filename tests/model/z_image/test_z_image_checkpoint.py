"""A Z-Image checkpoint in the diffusers layout loads into our modules with coverage checked both
ways (a parameter left unfilled and a tensor nothing loads each fail), and the loaded modules
compute what the diffusers / transformers modules they were saved from compute."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mstar.model.qwen3 import Qwen3Config
from mstar.model.weights import WeightLoadError, iter_safetensors, load_weights
from mstar.model.z_image import (
    ZImageTransformer,
    ZImageTransformerConfig,
    ZImageVAE,
    ZImageVAEConfig,
)
from mstar.model.z_image.text import ZImageText


def config(root, folder):
    return json.loads((root / folder / "config.json").read_text())


def test_transformer_folder_loads_and_matches(checkpoint):
    root = checkpoint.root
    dit = ZImageTransformer(ZImageTransformerConfig.from_dict(config(root, "transformer"))).eval()
    load_weights(dit, iter_safetensors(root / "transformer"))
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 4, 8, 12, generator=gen)
    captions = [torch.randn(n, 24, generator=gen) for n in (3, 33)]
    t = torch.tensor([0.2, 0.8])
    with torch.no_grad():
        want = checkpoint.transformer(list(latents.unsqueeze(2)), t, captions, return_dict=False)[0]
        got = dit(latents, t, captions)
    for g, w in zip(got, want):
        assert (g - w.squeeze(1)).abs().max() <= 1e-5 * w.abs().max()


def test_vae_folder_loads_and_matches(checkpoint):
    root = checkpoint.root
    vae = ZImageVAE(ZImageVAEConfig.from_dict(config(root, "vae"))).eval()
    load_weights(vae, iter_safetensors(root / "vae"))
    latents = torch.randn(1, 4, 8, 12, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = checkpoint.vae.decode(latents).sample
        got = vae.decode(latents)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_text_encoder_folder_loads_and_matches(checkpoint):
    root = checkpoint.root
    text = ZImageText.from_directory(root)
    encoder = text.build_encoder().eval()
    load_weights(encoder, iter_safetensors(root / "text_encoder"), name_map=encoder.checkpoint_name_map)
    prompts = ["a cat", "a cat at a castle"]
    want = checkpoint.pipeline()._encode_prompt(list(prompts), device=torch.device("cpu"))
    tokens = [text.tokenize(p) for p in prompts]
    got = text.encode(encoder, [ids for ids, _ in tokens], [mask for _, mask in tokens])
    for (_, mask), g, w in zip(tokens, got, want):
        n = int(mask.sum())
        assert n == len(w) and g.shape == (512, 24)
        assert (g[:n] - w).abs().max() <= 1e-5 * w.abs().max()
        assert not g[n:].any()


def test_coverage_is_checked_both_ways(checkpoint):
    root = checkpoint.root
    tensors = load_file(root / "transformer" / "diffusion_pytorch_model.safetensors")
    dit = ZImageTransformer(ZImageTransformerConfig.from_dict(config(root, "transformer")))
    missing = {k: v for k, v in tensors.items() if k != "cap_pad_token"}
    with pytest.raises(WeightLoadError, match="did not fill.*cap_pad_token"):
        load_weights(dit, missing.items())
    extra = {**tensors, "siglip_pad_token": torch.zeros(1, 32)}
    with pytest.raises(WeightLoadError, match="nothing loads.*siglip_pad_token"):
        load_weights(dit, extra.items())
    assert Qwen3Config.from_hf_dict(config(root, "text_encoder")).num_hidden_layers == 4
