"""Where V-JEPA 2's config and weights come from.

``vjepa2``: a Hugging Face directory (``facebook/vjepa2-vitl-fpc64-256`` in the hub cache, or a
local one) with ``config.json`` and ``model.safetensors`` in ``VJEPA2Model``'s key layout
(``encoder.*``, ``predictor.*``; a classifier's ``vjepa2.`` prefix is dropped and its ``pooler``
and ``classifier`` skipped).

``vjepa2_ac``: the official release, one PyTorch file (``vjepa2-ac-vitg.pt`` from
``dl.fbaipublicfiles.com/vjepa2/``) holding ``{"encoder": ..., "predictor": ...}`` state dicts
whose keys carry ``module.`` / ``backbone.`` prefixes. ``model_path`` is that file or a directory
holding it (and optionally a ``config.json`` of dimensions, ``VJEPA2ACConfig.from_json``). The
encoder's ``patch_embed`` / ``blocks.i.attn`` / ``norm`` map onto our Hugging Face-style names;
the predictor keeps its names but ``attn``, read as ``attention``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.model.vjepa2.config import VJEPA2ACConfig, VJEPA2Config
from mstar.model.vjepa2.modeling import VJEPA2ACModel, VJEPA2Model

log = logging.getLogger(__name__)

AC_FILE = "vjepa2-ac-vitg.pt"
AC_URL = "https://dl.fbaipublicfiles.com/vjepa2/vjepa2-ac-vitg.pt"


def hf_name(key: str) -> str | None:
    """A Hugging Face V-JEPA 2 key -> our parameter name (None: not ours to load)."""
    key = key.removeprefix("vjepa2.")
    return None if key.startswith(("pooler.", "classifier.")) else key


def ac_name(key: str) -> str:
    """An official 2-AC key (``encoder.`` / ``predictor.`` + the state dict's key) -> ours."""
    part, _, rest = key.partition(".")
    rest = rest.replace("module.", "").replace("backbone.", "")
    if part == "predictor":
        return "predictor." + re.sub(r"^predictor_blocks\.(\d+)\.attn\.", r"predictor_blocks.\1.attention.", rest)
    rest = re.sub(r"^blocks\.(\d+)\.attn\.", r"layer.\1.attention.", rest)
    rest = re.sub(r"^blocks\.", "layer.", rest)
    rest = re.sub(r"^patch_embed\.", "embeddings.patch_embeddings.", rest)
    rest = re.sub(r"^norm\.", "layernorm.", rest)
    return f"{part}.{rest}"


def _build(model_cls, config, device: torch.device, dtype: torch.dtype, tensors, name_map, *, dummy: bool,
           seed: int, path: Path):
    from mstar.model.weights import building, fill_weights

    with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
        model = model_cls(config.encoder, config.predictor)
    log.info("loading %s weights (%s)", path, "dummy" if dummy else "checkpoint")
    return fill_weights(model, tensors, dummy=dummy, seed=seed, dtype=dtype, name_map=name_map)


@dataclass
class VJEPA2Checkpoint:
    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> VJEPA2Checkpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (a Hugging Face V-JEPA 2 directory)")
        return cls(path)

    def config(self) -> VJEPA2Config:
        return VJEPA2Config.from_hf(json.loads((self.path / "config.json").read_text()))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        return iter_safetensors(self.path)

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> VJEPA2Model:
        """The encoder and predictor with the checkpoint's weights (coverage checked both ways) or
        seeded random ones (``dummy``), in eval mode."""
        return _build(VJEPA2Model, self.config(), device, dtype, self.tensors, hf_name, dummy=dummy, seed=seed,
                      path=self.path)


@dataclass
class VJEPA2ACCheckpoint:
    path: Path  # the directory
    weights: Path | None  # the .pt file (None: not there; only dummy weights can load)

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> VJEPA2ACCheckpoint:
        local = Path(model_path).expanduser()
        if local.is_file():
            return cls(local.parent, local)
        if not local.exists():
            from mstar.model.weights import ModelPathError, resolve_model_path

            try:
                local = resolve_model_path(model_path, cache_dir=cache_dir)
            except ModelPathError as err:
                raise ValueError(f"model_path {model_path!r}: not found; download {AC_URL} and point "
                                 f"model_path at it or at its directory ({err})") from None
        files = [local / AC_FILE] if (local / AC_FILE).is_file() else sorted(local.glob("*.pt"))
        if len(files) > 1:
            raise ValueError(f"model_path {local}: several .pt files ({[f.name for f in files]}); name one")
        return cls(local, files[0] if files else None)

    def config(self) -> VJEPA2ACConfig:
        path = self.path / "config.json"
        return VJEPA2ACConfig.from_json(json.loads(path.read_text())) if path.is_file() else VJEPA2ACConfig.released()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.weights is None:
            raise ValueError(f"model_path {self.path}: no .pt weights (the release is {AC_URL})")
        state = torch.load(self.weights, map_location="cpu", weights_only=True, mmap=True)
        for part in ("encoder", "predictor"):
            if part not in state:
                raise ValueError(f"{self.weights}: no {part!r} state dict (keys: {sorted(state)})")
            for key, value in state[part].items():
                yield f"{part}.{key}", value

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> VJEPA2ACModel:
        return _build(VJEPA2ACModel, self.config(), device, dtype, self.tensors, ac_name, dummy=dummy, seed=seed,
                      path=self.weights or self.path)
