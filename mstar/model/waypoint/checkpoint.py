"""Where Waypoint's configs and weights come from: a directory (``Overworld/Waypoint-1.5-1B`` in
the hub cache, or a local one) laid out as Overworld's ``world_engine`` loads a model:

* ``config.yaml``: the DiT's hyper-parameters as top-level keys (``WaypointConfig``) and, unless
  the directory has an ``ae/`` folder, ``ae_uri``: where the autoencoder lives (a hub id or a
  path, relative paths from the model directory);
* ``model.safetensors``: the DiT's state dict (``transformer.blocks.N.attn.q_proj.weight``, ...),
  under any of the spellings ``released_tensors`` maps (one conditioning head a block, or one
  for attention and one for the MLP: read from the keys);
* the autoencoder's directory (``ae/`` or ``ae_uri``): ``config.json`` with ``TAEHVConfig``'s keys
  (absent: TAEHV 1.5's, 32 latent channels, 2x2 pixel patches) and one ``*.safetensors`` or
  ``*.pth`` (``taehv1_5.pth``, as Overworld's engine loads it) in madebyollin/taehv's key
  layout (``encoder.N.*``, ``decoder.N.*``).

The released 1.5 repository's exact autoencoder layout was not available to this port; see
``docs/waypoint.md``. Both halves load with coverage checked both ways (``fill_weights``): a
parameter nothing fills, or a tensor nothing loads, fails startup naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
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
from mstar.model.weights import building, fill_weights, resolve_model_path

CONFIG = "config.yaml"
WEIGHTS = "model.safetensors"
AE_DIR = "ae"
TAEHV_1_5 = "taehv1_5.pth"  # the file Overworld's engine loads from its autoencoder repository


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def released_tensors(named: Iterable[tuple[str, torch.Tensor]], config: WaypointConfig):
    """world_engine's other spellings of the DiT's tensors, as our modules name them (each seen
    in Overworld's loaders; which one a release uses is read, not assumed):

    * ``dit_mlp.*`` for a block's ``mlp.*``;
    * ``ctrl_mlpfusion.fc1_x`` / ``fc1_c`` / ``fc2`` for the fusion MLP's halves of ``fc1``;
    * a 4-d ``unpatchify.weight`` (a strided transposed conv, ``[d, C, ph, pw]``) and its
      per-channel bias, for the linear ``[C * ph * pw, d]`` and its per-output bias;
    * a 2-d ``patchify.weight`` for the strided conv's 4-d one.
    """
    ph, pw = config.patch
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        if ".dit_mlp." in name:
            name = name.replace(".dit_mlp.", ".mlp.")
        elif ".ctrl_mlpfusion.fc1_" in name:
            prefix, half = name.rsplit(".fc1_", 1)
            got = halves.setdefault(prefix, {})
            got[half.split(".")[0]] = tensor
            if len(got) == 2:
                yield f"{prefix}.mlp.fc1.weight", torch.cat((got.pop("x"), got.pop("c")), 1)
                del halves[prefix]
            continue
        elif name.endswith(".ctrl_mlpfusion.fc2.weight"):
            name = name.replace(".ctrl_mlpfusion.fc2.", ".ctrl_mlpfusion.mlp.fc2.")
        elif name == "unpatchify.weight" and tensor.dim() == 4:
            tensor = tensor.permute(1, 2, 3, 0).reshape(-1, tensor.shape[0])
        elif name == "unpatchify.bias" and tensor.numel() == config.channels and ph * pw > 1:
            tensor = tensor.repeat_interleave(ph * pw)
        elif name == "patchify.weight" and tensor.dim() == 2:
            tensor = tensor.view(tensor.shape[0], config.channels, ph, pw)
        yield name, tensor
    for prefix, got in halves.items():  # a half without its pair: coverage names it
        for half, tensor in got.items():
            yield f"{prefix}.fc1_{half}.weight", tensor


def _tensors(path: Path):
    def read():
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
    return read


def taehv_tensors(path: Path, tae: TAEHV):
    """The autoencoder's tensors. A time-grow conv saved wider than the model builds it (trained
    with time upscaling the config turns off) keeps its last time step's channels, as taehv's
    own loader does."""
    named = _tensors(path)() if path.suffix == ".safetensors" else torch.load(
        path, map_location="cpu", weights_only=True).items()
    wanted = dict(tae.state_dict())
    for name, tensor in named:
        target = wanted.get(name)
        if target is not None and name.startswith("decoder.") and tensor.dim() == 4 and \
                tensor.shape[0] > target.shape[0] and tensor.shape[1:] == target.shape[1:]:
            tensor = tensor[-target.shape[0]:]
        yield name, tensor


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
        """``taehv1_5.pth`` when the autoencoder's folder has it, else its one ``*.safetensors``, or
        else its one ``*.pth`` (taehv's own files, read with ``weights_only``)."""
        folder = self.ae_dir()
        if (folder / TAEHV_1_5).is_file():  # a folder of several taehv variants: the 1.5 one
            return folder / TAEHV_1_5
        files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.pth"))
        if len(files) != 1:
            raise FileNotFoundError(f"{folder} should hold one .safetensors (or one .pth) of TAEHV weights, "
                                    f"has {[f.name for f in files]}")
        return files[0]

    def load_dit(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> WorldDiT:
        config = self.config()
        if not dummy:
            config.split_cond_heads = any(".attn_cond_head." in k for k in _keys(self.root / WEIGHTS))
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            dit = WorldDiT(config)
        dit = fill_weights(dit, lambda: released_tensors(_tensors(self.root / WEIGHTS)(), config),
                           dummy=dummy, seed=seed)
        dit.denoise_step_emb.float()  # float32 in any deployment, as the reference keeps it
        return dit

    def load_taehv(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> TAEHV:
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            tae = TAEHV(self.ae_config())
        return fill_weights(tae, lambda: taehv_tensors(self.ae_weights(), tae), dummy=dummy, seed=seed)

    def load_world(self, device: torch.device, dtype: torch.dtype, *, dummy: bool = False,
                   seed: int = 0) -> WaypointWorld:
        dit = self.load_dit(device, dtype, dummy=dummy, seed=seed)
        tae = self.load_taehv(device, dtype, dummy=dummy, seed=seed + 1)
        return WaypointWorld(dit, tae, device, dtype)
