"""Where LingBot-World's weights come from.

The release (``robbyant/lingbot-world-v2-1.3b-causal-fast``) ships the causal DiT only: its
safetensors (shards with ``model.safetensors.index.json``, or one file) at the repository root, in the reference's key
names (``blocks.0.self_attn.q.weight``, ``head.modulation``, ``cam_injector_layer1``, ...),
with an optional ``config.json`` in the reference's constructor names (``dim``, ``num_heads``,
``local_attn_size``, ...). ``dit_name`` renames the Wan parts to the diffusers names our blocks
carry (the renaming diffusers' single-file converter does) and the camera parts into
``camera_embedder``; loading checks coverage both ways.

The prompt encoder (UMT5-XXL), its tokenizer and the Wan2.1 VAE come from a diffusers-layout
Wan2.1 checkpoint (``text_encoder/``, ``tokenizer/``, ``vae/``; ``Wan-AI/Wan2.1-T2V-1.3B-
Diffusers`` by default, or the release directory itself when it holds them). The reference
reads the same weights from Wan's original ``.pth`` files, which are not read here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mstar.model.diffusers_checkpoint import DiffusersCheckpoint
from mstar.model.lingbot.config import LingbotConfig
from mstar.model.lingbot.transformer import LingbotTransformer
from mstar.model.wan22.text import WanText
from mstar.model.wan22.vae import WanVAEConfig

DEFAULT_ASSETS = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
_BLOCK_RENAMES = (
    (r"\.self_attn\.", ".attn1."), (r"\.cross_attn\.", ".attn2."),
    (r"\.(attn[12])\.([qkv])\.", r".\1.to_\2."), (r"\.(attn[12])\.o\.", r".\1.to_out.0."),
    (r"\.norm3\.", ".norm2."),  # the cross-attention norm
    (r"\.ffn\.0\.", ".ffn.net.0.proj."), (r"\.ffn\.2\.", ".ffn.net.2."),
    (r"\.modulation$", ".scale_shift_table"),
)
_TOP_RENAMES = {
    "text_embedding.0.": "condition_embedder.text_embedder.linear_1.",
    "text_embedding.2.": "condition_embedder.text_embedder.linear_2.",
    "time_embedding.0.": "condition_embedder.time_embedder.linear_1.",
    "time_embedding.2.": "condition_embedder.time_embedder.linear_2.",
    "time_projection.1.": "condition_embedder.time_proj.",
    "head.head.": "proj_out.",
    "patch_embedding_wancamctrl.": "camera_embedder.patch_embedding_wancamctrl.",
    "c2ws_hidden_states_layer1.": "camera_embedder.c2ws_hidden_states_layer1.",
    "c2ws_hidden_states_layer2.": "camera_embedder.c2ws_hidden_states_layer2.",
}


def dit_name(name: str) -> str:
    """A released DiT key -> our parameter name."""
    name = name.removeprefix("model.diffusion_model.")
    if name == "head.modulation":
        return "scale_shift_table"
    if name.startswith("blocks."):
        for pattern, new in _BLOCK_RENAMES:
            name = re.sub(pattern, new, name)
        return name
    for old, new in _TOP_RENAMES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def config_from_reference(data: dict, base: LingbotConfig) -> LingbotConfig:
    """``base`` with the DiT shape and the cache window of a reference ``config.json``."""
    dit = base.dit
    heads = int(data.get("num_heads", dit.num_attention_heads))
    dim = int(data.get("dim", dit.dim))
    dit = replace(dit, num_attention_heads=heads, attention_head_dim=dim // heads,
                  in_channels=int(data.get("in_dim", dit.in_channels)),
                  out_channels=int(data.get("out_dim", dit.out_channels)),
                  text_dim=int(data.get("text_dim", dit.text_dim)), freq_dim=int(data.get("freq_dim", dit.freq_dim)),
                  ffn_dim=int(data.get("ffn_dim", dit.ffn_dim)), num_layers=int(data.get("num_layers", dit.num_layers)),
                  patch_size=tuple(data.get("patch_size", dit.patch_size)), eps=float(data.get("eps", dit.eps)),
                  cross_attn_norm=bool(data.get("cross_attn_norm", dit.cross_attn_norm)))
    window = int(data.get("local_attn_size", -1))
    return replace(base, dit=dit, window_frames=None if window < 0 else window,
                   sink_frames=int(data.get("sink_size", base.sink_frames)),
                   text_len=int(data.get("text_len", base.text_len)))


@dataclass(frozen=True)
class LingbotCheckpoint:
    root: Path  # the release: the DiT
    assets: DiffusersCheckpoint  # text encoder, tokenizer, VAE

    @classmethod
    def locate(cls, model_path: str, assets_path: str | None = None, cache_dir: str | None = None) -> LingbotCheckpoint:
        from mstar.model.weights import resolve_model_path

        root = resolve_model_path(model_path, cache_dir=cache_dir)
        if assets_path is None:
            assets_path = str(root) if (root / "vae" / "config.json").is_file() else DEFAULT_ASSETS
        return cls(root, DiffusersCheckpoint.locate(assets_path, cache_dir))

    def config(self, base: LingbotConfig | None = None) -> LingbotConfig:
        """The release's ``config.json`` over ``base`` (the 1.3B defaults), or ``base`` without one."""
        base = base or LingbotConfig()
        path = self.root / "config.json"
        return config_from_reference(json.loads(path.read_text()), base) if path.is_file() else base

    def text(self) -> WanText:
        return WanText.from_directory(self.assets.root)

    def vae_config(self) -> WanVAEConfig:
        config = WanVAEConfig.from_dict(self.assets.read_json("vae", "config.json"))
        if config.residual or config.z_dim != 16:
            raise ValueError(f"{self.assets.root / 'vae'}: LingBot-World needs the Wan2.1 VAE (is_residual false, "
                             f"z_dim 16), got is_residual {config.residual}, z_dim {config.z_dim}")
        return config

    def load_dit(self, config: LingbotConfig, *, device: torch.device, dtype: torch.dtype, dummy: bool,
                 seed: int) -> LingbotTransformer:
        """The DiT in ``dtype`` on ``device``, from the release's tensors (coverage both ways) or
        seeded dummy weights; the time MLP and the modulation tables stay float32."""
        from mstar.model.weights import building, fill_weights, iter_safetensors

        with building(device, dtype):
            dit = LingbotTransformer(config)
        for name, param in dit.named_parameters():
            if {"time_embedder", "scale_shift_table"} & set(name.split(".")):
                param.data = param.data.float()
        return fill_weights(dit, lambda: iter_safetensors(self.root), dummy=dummy, seed=seed, name_map=dit_name)
