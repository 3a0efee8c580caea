"""Where Waypoint's configs and weights come from: a directory (``Overworld/Waypoint-1.5-1B`` in
the hub cache, or a local one) laid out as Overworld's ``world_engine`` loads a model:

* ``config.yaml``: the DiT's hyper-parameters as top-level keys (``WaypointConfig``) and, unless
  the directory has an ``ae/`` folder, ``ae_uri``: where the autoencoder lives (a hub id or a
  path, relative paths from the model directory);
* ``model.safetensors``: the DiT's state dict (``transformer.blocks.N.attn.q_proj.weight``, ...);
* the autoencoder's directory (``ae/`` or ``ae_uri``): ``config.json`` with ``TAEHVConfig``'s keys
  (absent: TAEHV 1.5's, 32 latent channels, 2x2 pixel patches) and one ``*.safetensors`` in
  madebyollin/taehv's key layout (``encoder.N.*``, ``decoder.N.*``).

The released 1.5 repository's exact autoencoder layout was not available to this port; see
``docs/waypoint.md``. Both halves load with coverage checked both ways (``fill_weights``): a
parameter nothing fills, or a tensor nothing loads, fails startup naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open

from mstar.model.waypoint.config import TAEHVConfig, WaypointConfig
from mstar.model.waypoint.dit import WorldDiT
from mstar.model.waypoint.rollout import WaypointWorld
from mstar.model.waypoint.taehv import TAEHV
from mstar.model.weights import fill_weights, resolve_model_path

CONFIG = "config.yaml"
WEIGHTS = "model.safetensors"
AE_DIR = "ae"


def _tensors(path: Path):
    def read():
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
    return read


@dataclass(frozen=True)
class WaypointCheckpoint:
    root: Path
    cache_dir: str | None = None

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> WaypointCheckpoint:
        root = resolve_model_path(model_path, cache_dir=cache_dir)
        if not (root / CONFIG).is_file():
            raise FileNotFoundError(f"{root} has no {CONFIG} (a Waypoint model directory holds {CONFIG} and "
                                    f"{WEIGHTS})")
        return cls(root, cache_dir)

    def raw_config(self) -> dict[str, Any]:
        data = yaml.safe_load((self.root / CONFIG).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{self.root / CONFIG} is not a mapping of hyper-parameters")
        return data

    def config(self) -> WaypointConfig:
        return WaypointConfig.from_dict(self.raw_config())

    def ae_dir(self) -> Path:
        local = self.root / AE_DIR
        if local.is_dir():
            return local
        uri = self.raw_config().get("ae_uri")
        if not uri:
            raise FileNotFoundError(f"{self.root} has no {AE_DIR}/ folder and its {CONFIG} names no ae_uri")
        relative = self.root / str(uri)
        return relative if relative.is_dir() else resolve_model_path(str(uri), cache_dir=self.cache_dir)

    def ae_config(self) -> TAEHVConfig:
        path = self.ae_dir() / "config.json"
        return TAEHVConfig.from_dict(json.loads(path.read_text())) if path.is_file() else TAEHVConfig()

    def ae_weights(self) -> Path:
        files = sorted(self.ae_dir().glob("*.safetensors"))
        if len(files) != 1:
            raise FileNotFoundError(f"{self.ae_dir()} should hold one .safetensors of TAEHV weights, "
                                    f"has {[f.name for f in files]}")
        return files[0]

    def load_dit(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> WorldDiT:
        with torch.device(device):
            dit = WorldDiT(self.config())
        dit = fill_weights(dit.to(dtype), _tensors(self.root / WEIGHTS), dummy=dummy, seed=seed)
        dit.denoise_step_emb.float()  # float32 in any deployment, as the reference keeps it
        return dit

    def load_taehv(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> TAEHV:
        with torch.device(device):
            tae = TAEHV(self.ae_config())
        return fill_weights(tae.to(dtype), lambda: _tensors(self.ae_weights())(), dummy=dummy, seed=seed)

    def load_world(self, device: torch.device, dtype: torch.dtype, *, dummy: bool = False,
                   seed: int = 0) -> WaypointWorld:
        dit = self.load_dit(device, dtype, dummy=dummy, seed=seed)
        tae = self.load_taehv(device, dtype, dummy=dummy, seed=seed + 1)
        return WaypointWorld(dit, tae, device, dtype)
