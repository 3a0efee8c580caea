"""A tiny Cosmos3 checkpoint in the layout ``Cosmos3OmniPipeline`` saves (model_index.json,
transformer/, text_tokenizer/, vae/, scheduler/), written from diffusers modules with seeded
random weights; the tests compare our port against a pipeline built from those same modules."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.support.diffusers_dirs import randomize

for folder in ("..",):
    path = str((Path(__file__).parent / folder).resolve())
    if path not in sys.path:
        sys.path.append(path)

from test_qwen3_encoder import make_qwen_tokenizer  # noqa: E402

TOWER = dict(head_dim=16, hidden_size=32, intermediate_size=48, latent_channel=4, latent_patch_size=2,
             num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16,
             rope_theta=10000.0, rope_axes_dim=[4, 2, 2], unified_3d_mrope_temporal_modality_margin=50)
VAE = dict(base_dim=4, decoder_base_dim=6, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
           patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
           latents_mean=[0.1, -0.2, 0.3, 0.05], latents_std=[1.5, 0.7, 2.0, 1.1])
SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "flow_shift": 3.0, "num_train_timesteps": 1000,
             "prediction_type": "flow_prediction", "use_flow_sigmas": True, "solver_order": 2,
             "solver_type": "bh2", "predict_x0": True, "lower_order_final": True, "final_sigmas_type": "zero",
             "timestep_spacing": "linspace", "disable_corrector": []}
MODEL_INDEX = {"_class_name": "Cosmos3OmniPipeline", "default_use_system_prompt": True,
               "enable_safety_checker": False, "use_native_flow_schedule": False,
               "scheduler": ["diffusers", "UniPCMultistepScheduler"],
               "text_tokenizer": ["transformers", "Qwen2Tokenizer"],
               "transformer": ["diffusers", "Cosmos3OmniTransformer"], "vae": ["diffusers", "AutoencoderKLWan"]}


@dataclass
class Checkpoint:
    root: Path
    transformer: Any
    vae: Any
    tokenizer: Any

    def pipeline(self):
        from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

        pipe = Cosmos3OmniPipeline(transformer=self.transformer, text_tokenizer=self.tokenizer, vae=self.vae,
                                   scheduler=UniPCMultistepScheduler.from_config(SCHEDULER),
                                   enable_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe


def tokenizer():
    tok = make_qwen_tokenizer()
    tok.add_tokens(["<|vision_start|>"], special_tokens=True)
    return tok


def write_checkpoint(root: Path, tower: Any, vae: Any, tok: Any) -> None:
    tok.save_pretrained(root / "text_tokenizer")
    for folder, module in (("transformer", tower), ("vae", vae)):
        (root / folder).mkdir()
        (root / folder / "config.json").write_text(json.dumps(dict(module.config), default=list))
        save_file({k: v.contiguous() for k, v in module.state_dict().items()},
                  root / folder / "diffusion_pytorch_model.safetensors")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Checkpoint:
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer

    root = tmp_path_factory.mktemp("cosmos3")
    tok = tokenizer()
    tower = Cosmos3OmniTransformer(vocab_size=len(tok), **TOWER).eval()
    vae = AutoencoderKLWan(**VAE).eval()
    for seed, module in enumerate((tower, vae)):
        randomize(module, seed, gains=("gamma",))
    with torch.no_grad():  # keep most decoded pixels inside [-1, 1] so the frame comparison bites
        vae.decoder.conv_out.weight.mul_(0.3)
    write_checkpoint(root, tower, vae, tok)
    return Checkpoint(root, tower, vae, tok)


ACTION_TOWER = dict(TOWER, action_gen=True, action_dim=12, num_embodiment_domains=10)


@pytest.fixture(scope="session")
def action_checkpoint(tmp_path_factory) -> Checkpoint:
    """The tiny checkpoint with action heads (a policy fine-tune's layout: ``action_gen``, 12-wide
    heads, droid_lerobot's domain 8 among 10)."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer

    root = tmp_path_factory.mktemp("cosmos3_droid")
    tok = tokenizer()
    tower = Cosmos3OmniTransformer(vocab_size=len(tok), **ACTION_TOWER).eval()
    vae = AutoencoderKLWan(**VAE).eval()
    for seed, module in enumerate((tower, vae)):
        randomize(module, seed + 7, gains=("gamma",))
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(0.3)
    write_checkpoint(root, tower, vae, tok)
    return Checkpoint(root, tower, vae, tok)
