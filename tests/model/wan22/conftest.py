"""A tiny Wan2.2-TI2V checkpoint in the diffusers repository layout (model_index.json,
transformer/, vae/, text_encoder/, tokenizer/, scheduler/), written from diffusers /
transformers modules with seeded random weights; the tests compare our port against those
same modules."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.diffusers_dirs import make_t5_tokenizer, randomize, write_diffusers_dir

UMT5 = dict(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu",
            dropout_rate=0.0)
DIT = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
           text_dim=32, freq_dim=32, ffn_dim=40, num_layers=2, cross_attn_norm=True,
           qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)
VAE = dict(base_dim=4, decoder_base_dim=6, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
           patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
           latents_mean=[0.1, -0.2, 0.3, 0.05], latents_std=[1.5, 0.7, 2.0, 1.1])
SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "beta_end": 0.02, "beta_schedule": "linear",
             "beta_start": 0.0001, "disable_corrector": [], "dynamic_thresholding_ratio": 0.995,
             "final_sigmas_type": "zero", "flow_shift": 5.0, "lower_order_final": True, "num_train_timesteps": 1000,
             "predict_x0": True, "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False,
             "sample_max_value": 1.0, "solver_order": 2, "solver_p": None, "solver_type": "bh2", "steps_offset": 0,
             "thresholding": False, "timestep_spacing": "linspace", "trained_betas": None, "use_beta_sigmas": False,
             "use_exponential_sigmas": False, "use_flow_sigmas": True, "use_karras_sigmas": False}
MODEL_INDEX = {"_class_name": "WanPipeline", "boundary_ratio": None, "expand_timesteps": True,
               "scheduler": ["diffusers", "UniPCMultistepScheduler"],
               "text_encoder": ["transformers", "UMT5EncoderModel"],
               "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
               "transformer_2": [None, None], "vae": ["diffusers", "AutoencoderKLWan"]}


@dataclass
class Checkpoint:
    root: Path
    transformer: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any

    def pipeline(self, image: bool = False):
        from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline

        scheduler = UniPCMultistepScheduler.from_config(SCHEDULER)
        parts = dict(tokenizer=self.tokenizer, text_encoder=self.text_encoder, vae=self.vae, scheduler=scheduler,
                     transformer=self.transformer, expand_timesteps=True)
        pipe = WanImageToVideoPipeline(**parts) if image else WanPipeline(**parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Checkpoint:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    root = tmp_path_factory.mktemp("wan22")
    tokenizer = make_t5_tokenizer()
    dit = WanTransformer3DModel(**DIT).eval()
    vae = AutoencoderKLWan(**VAE).eval()
    text = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **UMT5)).eval()
    for seed, module in enumerate((dit, vae, text)):
        randomize(module, seed, gains=("gamma",))
    with torch.no_grad():  # keep most decoded pixels inside [-1, 1] so the frame comparison bites
        vae.decoder.conv_out.weight.mul_(0.3)
    write_diffusers_dir(root, transformer=dit, vae=vae, text_encoder=text, tokenizer=tokenizer,
                        scheduler=SCHEDULER, model_index=MODEL_INDEX)
    return Checkpoint(root, dit, vae, text, tokenizer)
