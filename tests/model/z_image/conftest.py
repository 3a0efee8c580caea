"""A tiny Z-Image checkpoint in the diffusers repository layout (model_index.json, transformer/,
vae/, text_encoder/, tokenizer/, scheduler/), written from diffusers / transformers modules with
seeded random weights; the tests compare our port against those same modules."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.diffusers_dirs import randomize, write_diffusers_dir

# Shared helpers of the sibling test directories (the Qwen tokenizer, in-process deployment tools).
for folder in ("..", "../../e2e"):
    path = str((Path(__file__).parent / folder).resolve())
    if path not in sys.path:
        sys.path.append(path)

from test_qwen3_encoder import make_qwen_tokenizer  # noqa: E402

QWEN = {"hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 12, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
        "tie_word_embeddings": False}
DIT = {"all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 4, "dim": 32, "n_layers": 2,
       "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "norm_eps": 1e-5, "qk_norm": True,
       "cap_feat_dim": QWEN["hidden_size"], "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": (4, 6, 6),
       "axes_lens": (1024, 64, 64)}
VAE = {"block_out_channels": (8, 16, 16), "down_block_types": ("DownEncoderBlock2D",) * 3,
       "up_block_types": ("UpDecoderBlock2D",) * 3, "layers_per_block": 1, "latent_channels": 4,
       "norm_num_groups": 4, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
       "use_post_quant_conv": False}
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
             "use_dynamic_shifting": False, "shift": 3.0}


@dataclass
class Checkpoint:
    root: Path
    transformer: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any

    def pipeline(self):
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER)
        pipe = ZImagePipeline(scheduler, self.vae, self.text_encoder, self.tokenizer, self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Checkpoint:
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    root = tmp_path_factory.mktemp("z_image")
    tokenizer = make_qwen_tokenizer()
    dit = ZImageTransformer2DModel(**DIT).eval()
    vae = AutoencoderKL(**VAE).eval()
    text = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), **QWEN)).eval()
    for seed, module in enumerate((dit, vae, text)):
        randomize(module, seed, offsets=("pad_token",))
    with torch.no_grad():  # keep most decoded pixels inside [-1, 1] so the image comparison bites
        vae.decoder.conv_out.weight.mul_(0.3)
    write_diffusers_dir(root, transformer=dit, vae=vae, text_encoder=text, tokenizer=tokenizer,
                        scheduler=SCHEDULER, model_index={
        "_class_name": "ZImagePipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3Model"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "ZImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]})
    return Checkpoint(root, dit, vae, text, tokenizer)
