"""A tiny LTX-2.5 checkpoint in the diffusers repository layout (model_index.json, text_encoder/
as a Gemma 4 conditional-generation checkpoint with a stray image-tower tensor, tokenizer/,
connectors/, transformer/, vae/, audio_vae/, vocoder/, scheduler/), written from the diffusers /
transformers modules with seeded random weights; the tests compare our port against those
same modules (``Checkpoint.pipeline()`` assembles diffusers' ``LTX2Pipeline`` from them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.support.diffusers_dirs import randomize
from tests.support.ltx2_5_tiny import AUDIO_VAE, SCHEDULER, VAE, VOCODER

GEMMA = dict(vocab_size=128, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
             attention_k_eq_v=True, sliding_window=3, num_kv_shared_layers=1,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
CONNECTORS = dict(caption_channels=16, text_proj_in_factor=5, video_connector_num_attention_heads=2,
                  video_connector_attention_head_dim=8, video_connector_num_layers=1,
                  video_connector_num_learnable_registers=4, audio_connector_num_attention_heads=2,
                  audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
                  audio_connector_num_learnable_registers=4, connector_rope_base_seq_len=64, rope_type="split",
                  per_modality_projections=True, video_hidden_dim=16, audio_hidden_dim=8, video_gated_attn=True,
                  audio_gated_attn=True)
DIT = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
           audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=4,
           audio_cross_attention_dim=8, num_layers=2, rope_type="split", gated_attn=True, audio_gated_attn=True,
           cross_attn_mod=True, audio_cross_attn_mod=True, use_prompt_embeddings=False, ff_bias=False,
           audio_ff_bias=False, use_prompt_adaln_single=False, base_height=256, base_width=256)
MODEL_INDEX = {"_class_name": "LTX2Pipeline", "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"],
               "connectors": ["ltx2", "LTX2TextConnectors"],
               "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
               "text_encoder": ["transformers", "Gemma4UnifiedForConditionalGeneration"],
               "tokenizer": ["transformers", "T5TokenizerFast"],
               "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],
               "vae": ["diffusers", "AutoencoderKLLTX2Video"], "vocoder": ["ltx2", "LTX2VocoderWithBWE"]}
PROMPT_TOKENS = 12


@dataclass
class Checkpoint:
    root: Path
    modules: dict[str, Any]
    tokenizer: Any

    def pipeline(self):
        from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

        return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), tokenizer=self.tokenizer,
                            **self.modules)


def write_folder(root: Path, folder: str, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 name: str = "diffusion_pytorch_model.safetensors") -> None:
    (root / folder).mkdir()
    (root / folder / "config.json").write_text(json.dumps(config, default=list))
    save_file({k: v.contiguous() for k, v in tensors.items()}, root / folder / name)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Checkpoint:
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE
    from transformers import Gemma4UnifiedTextConfig
    from transformers.models.gemma4_unified.modeling_gemma4_unified import Gemma4UnifiedForCausalLM

    from tests.support.diffusers_dirs import make_t5_tokenizer

    torch.manual_seed(0)
    gemma_config = Gemma4UnifiedTextConfig(**GEMMA)
    modules = dict(text_encoder=Gemma4UnifiedForCausalLM(gemma_config), connectors=LTX2TextConnectors(**CONNECTORS),
                   transformer=LTX2VideoTransformer3DModel(**DIT), vae=AutoencoderKLLTX2Video(**VAE),
                   audio_vae=AutoencoderKLLTX2Audio(**AUDIO_VAE), vocoder=LTX2VocoderWithBWE(**VOCODER))
    for seed, module in enumerate(modules.values()):
        randomize(module.eval(), seed, spread=0.3, weight_gain=1.2, offsets=("learnable_registers",))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for vae in (modules["vae"], modules["audio_vae"]):
            vae.latents_mean.normal_(generator=gen).mul_(0.3)
            vae.latents_std.uniform_(0.5, 1.5, generator=gen)
        modules["vocoder"].mel_stft.stft_fn.forward_basis.normal_(generator=gen)
        modules["vocoder"].mel_stft.mel_basis.uniform_(0.0, 1.0, generator=gen)

    root = tmp_path_factory.mktemp("ltx2_5")
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX))
    gemma = {f"model.language_model.{k.removeprefix('model.')}": v
             for k, v in modules["text_encoder"].state_dict().items() if k != "lm_head.weight"}
    gemma["model.vision_tower.patch_embedder.weight"] = torch.zeros(4, 4)  # a tower the text path never loads
    write_folder(root, "text_encoder", {"model_type": "gemma4_unified", "text_config": gemma_config.to_dict()},
                 gemma, "model.safetensors")
    for folder in ("connectors", "transformer", "vae", "audio_vae", "vocoder"):
        module = modules[folder]
        write_folder(root, folder, {"_class_name": type(module).__name__, **dict(module.config)}, module.state_dict())
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    tokenizer = make_t5_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    return Checkpoint(root, modules, tokenizer)
