"""Where Command A+'s config, tokenizer and weights come from: a local Hugging Face directory
(or one already in the hub cache). The ~437 GB of weights are never downloaded here: a
``model_path`` that is neither fails, saying so.

Key layouts read (safetensors):

* the vision-language release as transformers 5 writes it: ``model.language_model.*`` (the
  decoder, experts stored one by one: ``mlp.experts.{i}.{gate,up,down}_proj.weight``),
  ``model.vision_tower.*`` (SigLIP; its pooling ``head`` is unused and skipped) and
  ``model.multi_modal_projector.*``;
* the older layout of that release: ``language_model.model.*``,
  ``vision_tower.vision_model.*``, ``multi_modal_projector.*``;
* a text-only ``Cohere2MoeForCausalLM``: ``model.*``.

``lm_head.weight``, when written, is the tied embedding and is skipped. Everything else must
fill exactly the model's parameters (``load_weights``' two-way coverage).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.model.command_a_plus.config import CommandAPlusConfig, CommandVisionConfig
from mstar.model.command_a_plus.modeling import CommandAPlusForCausalLM

log = logging.getLogger(__name__)

_RENAMES = (  # checkpoint prefix -> ours, first match wins
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("model.vision_tower.vision_model.", "vision.vision_tower."),
    ("model.vision_tower.", "vision.vision_tower."),
    ("vision_tower.vision_model.", "vision.vision_tower."),
    ("model.multi_modal_projector.", "vision.multi_modal_projector."),
    ("multi_modal_projector.", "vision.multi_modal_projector."),
)


def checkpoint_name(name: str) -> str | None:
    """Our parameter name for a checkpoint tensor's (None: skipped)."""
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return None  # tied to the embeddings
    for prefix, ours in _RENAMES:
        if name.startswith(prefix):
            name = ours + name[len(prefix):]
            break
    if name.startswith("vision.vision_tower.head."):
        return None  # SigLIP's pooling head: the projector reads the last hidden states
    return name


def locate(model_path: str, cache_dir: str | None = None) -> Path:
    """The local directory of ``model_path``: a directory, or a hub id already in the cache.
    Never downloads."""
    from mstar.model.weights import ModelPathError

    local = Path(model_path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelPathError(f"model_path {model_path!r}: no config.json in that directory")
        return local
    if not local.exists() and model_path.count("/") == 1 and not model_path.startswith((".", "/", "~")):
        import huggingface_hub

        try:
            return Path(huggingface_hub.snapshot_download(model_path, cache_dir=cache_dir, local_files_only=True))
        except Exception:  # not in the cache: we do not fetch it
            pass
    raise ModelPathError(
        f"model_path {model_path!r}: Command A+'s weights (~437 GB in bf16) are never downloaded automatically; "
        "download the checkpoint yourself and set model_path to its directory (or use load_format: dummy)")


@dataclass
class CommandAPlusCheckpoint:
    path: Path

    @classmethod
    def locate(cls, model_path: str | os.PathLike[str], cache_dir: str | None = None) -> CommandAPlusCheckpoint:
        return cls(locate(os.fspath(model_path), cache_dir))

    def hf_config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    def config(self) -> CommandAPlusConfig:
        return CommandAPlusConfig.from_hf_dict(self.hf_config())

    def vision_config(self) -> CommandVisionConfig | None:
        return CommandVisionConfig.from_hf_dict(self.hf_config())

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        return iter_safetensors(self.path)

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int,
                   vision: bool = True) -> CommandAPlusForCausalLM:
        """The decoder (and, with ``vision`` and a vision-language config, the image encoder on
        the first TP rank) on ``device`` in ``dtype``, with the checkpoint's weights (or seeded random ones when
        ``dummy``), in eval mode. Without ``vision`` the image tensors are skipped."""
        from mstar.model.weights import building, fill_weights

        vision_config = self.vision_config() if vision else None
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = CommandAPlusForCausalLM(self.config(), vision_config)
        log.info("loading %s weights (%s)", self.path, "dummy" if dummy else "safetensors")

        def name_map(name: str) -> str | None:  # the encoder's tensors only where it lives (TP rank 0)
            ours = checkpoint_name(name)
            return None if ours is not None and ours.startswith("vision.") and model.vision is None else ours

        return fill_weights(model, self.tensors, dummy=dummy, seed=seed, dtype=dtype, name_map=name_map)
