"""A tiny Waypoint for tests: DiT and TAEHV configs small enough for the CPU that still exercise
grouped-query attention, value residuals, attention gates, local and dilated global windows,
control fusion on some layers only, 1x2 patches and TAEHV's time compression."""

from __future__ import annotations

import math

import torch
from torch import nn

from mstar.model.waypoint.config import TAEHVConfig, WaypointConfig

TINY_DIT = {
    "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "n_layers": 3, "mlp_ratio": 2, "channels": 4,
    "height": 2, "width": 2, "patch": [1, 2], "n_frames": 64, "n_buttons": 5, "local_window": 2,
    "global_window": 8, "global_attn_period": 2, "global_attn_offset": 0, "global_pinned_dilation": 2,
    "ctrl_conditioning_period": 2, "noise_conditioning": "wan", "value_residual": True, "gated_attn": True,
    "ctrl_conditioning": "mlp_fusion", "scheduler_sigmas": [1.0, 0.6, 0.3, 0.0],
}
TINY_TAEHV = {"latent_channels": 4, "patch_size": 1, "encoder_time_downscale": [True, True, False],
              "decoder_time_upscale": [False, True, True]}


def tiny_dit_config(**overrides) -> WaypointConfig:
    return WaypointConfig.from_dict({**TINY_DIT, **overrides})


def tiny_taehv_config(**overrides) -> TAEHVConfig:
    return TAEHVConfig.from_dict({**TINY_TAEHV, **overrides})


@torch.no_grad()
def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Weights of unit-scale activations (not the near-zero dummy init), so that every path,
    gates and value mixing included, moves the outputs."""
    gen = torch.Generator().manual_seed(seed)
    for _, param in sorted(module.named_parameters()):
        if param.dim() >= 2:
            fan_in = math.prod(param.shape[1:])
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
        else:
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return module.eval()


def snapshot_dir(cache, repo: str):
    """An empty snapshot of ``repo`` in the hub cache at ``cache`` (refs/main names it)."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    snapshot = root / "snapshots" / ("d" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text("d" * 40)
    return snapshot


def write_checkpoint(root, seed: int = 0, ae_subdir: str = "ae", **dit_overrides):
    """A tiny Waypoint directory in the released layout (``config.yaml``, ``model.safetensors``,
    the TAEHV folder with ``config.json`` and its weights); returns the source modules."""
    import json

    import yaml
    from safetensors.torch import save_file

    from mstar.model.waypoint.dit import WorldDiT
    from mstar.model.waypoint.taehv import TAEHV

    root.mkdir(parents=True, exist_ok=True)
    config = {**TINY_DIT, **dit_overrides, "ae_uri": ae_subdir, "ctrl_cond_dropout": 0.1}  # a training-only key
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    dit = randomize(WorldDiT(WaypointConfig.from_dict(config)), seed)
    save_file({k: v.clone() for k, v in dit.state_dict().items()}, str(root / "model.safetensors"))  # tied: copies
    ae = root / ae_subdir
    ae.mkdir(parents=True, exist_ok=True)
    (ae / "config.json").write_text(json.dumps(TINY_TAEHV))
    tae = randomize(TAEHV(TAEHVConfig.from_dict(TINY_TAEHV)), seed + 1)
    save_file({k: v.clone() for k, v in tae.state_dict().items()}, str(ae / "taehv.safetensors"))
    return dit, tae
