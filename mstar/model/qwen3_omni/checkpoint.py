"""Qwen3-Omni's released key layout onto our modules.

The released checkpoint holds the whole model under four prefixes: ``thinker.`` (``model``:
the text decoder, ``audio_tower``, ``visual``, ``lm_head``), ``talker.``, ``code2wav.`` and
the talker's code predictor inside ``talker.``. The thinker and the codec decoder
(``load_code2wav``) load apart, each skipping the other's keys by prefix. Experts are stored apart
(``mlp.experts.{i}.gate_proj.weight`` ...); ``load_weights`` stacks them (``SparseMoE``). A
checkpoint saved by transformers 5 may hold them stacked instead (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``): those load whole (``stacked_name``).
Under tensor parallelism either layout gives each rank its slice of every expert.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.model.hf_config import generation_eos
from mstar.model.qwen3_omni.audio import Qwen3OmniAudioConfig, Qwen3OmniAudioEncoder
from mstar.model.qwen3_omni.code2wav import Qwen3OmniCode2Wav, Qwen3OmniCode2WavConfig
from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig
from mstar.model.qwen3_omni.modeling import Qwen3OmniThinkerForCausalLM
from mstar.model.qwen3_omni.talker import Qwen3OmniTalker
from mstar.model.qwen3_omni.vision import Qwen3OmniVisionConfig, Qwen3OmniVisionEncoder
from mstar.model.weights import iter_safetensors, load_weights

THINKER = "thinker."
CPU = torch.device("cpu")
# what the thinker's text decoder does not load: the other components and the thinker's encoders
NOT_TEXT = ("thinker.audio_tower.", "thinker.visual.", "talker.", "code2wav.")


# transformers' stacked expert tensors -> our stacked parameters
STACKED = {"mlp.experts.gate_up_proj": "mlp.experts.gate_up.weight", "mlp.experts.down_proj": "mlp.experts.down.weight"}


def stacked_name(name: str) -> str:
    """``name`` with a stacked expert tensor's suffix renamed to our parameter's (else as is)."""
    for theirs, ours in STACKED.items():
        if name.endswith(theirs):
            return name[: -len(theirs)] + ours
    return name


def thinker_text_name(name: str) -> str | None:
    """Our name in ``Qwen3OmniThinkerForCausalLM`` of a released checkpoint key (``None``: a
    key of another component, skipped). Keys outside the known prefixes pass through unchanged,
    so ``load_weights`` reports them."""
    if name.startswith(NOT_TEXT):
        return None
    name = stacked_name(name)
    return name[len(THINKER):] if name.startswith(THINKER) else name


def load_thinker_text(model: Qwen3OmniThinkerForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]],
                      dtype: torch.dtype | None = None) -> None:
    """Fill the thinker's text decoder from released keys, with two-way coverage."""
    load_weights(model, tensors, name_map=thinker_text_name, dtype=dtype)


AUDIO_TOWER = "thinker.audio_tower."


def part_names(prefix: str) -> Callable[[str], str | None]:
    """The name map of a part stored under ``prefix``: a released key less the prefix, None for
    another part's key (skipped)."""
    return lambda name: name[len(prefix):] if name.startswith(prefix) else None


audio_tower_name = part_names(AUDIO_TOWER)  # Qwen3OmniAudioEncoder's names


def load_audio_tower(encoder: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                     dtype: torch.dtype | None = None) -> None:
    """Fill the audio encoder from the released ``thinker.audio_tower.`` keys (every parameter
    must be filled, and every such key must load)."""
    load_weights(encoder, tensors, name_map=audio_tower_name, dtype=dtype)


VISUAL = "thinker.visual."


visual_name = part_names(VISUAL)  # Qwen3OmniVisionEncoder's names


def load_visual(encoder: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                dtype: torch.dtype | None = None) -> None:
    """Fill the vision encoder from the released ``thinker.visual.`` keys (every parameter
    must be filled, and every such key must load)."""
    load_weights(encoder, tensors, name_map=visual_name, dtype=dtype)


CODE2WAV = "code2wav."


code2wav_name = part_names(CODE2WAV)  # Qwen3OmniCode2Wav's names


def load_code2wav(decoder: Qwen3OmniCode2Wav, tensors: Iterable[tuple[str, torch.Tensor]],
                  dtype: torch.dtype | None = None) -> None:
    """Fill the codec decoder from the released ``code2wav.`` keys (every parameter must be
    filled, and every such key must load); the other components' keys are skipped."""
    load_weights(decoder, tensors, name_map=code2wav_name, dtype=dtype)


def load_code2wav_dir(path: str | Path, dtype: torch.dtype | None = None) -> Qwen3OmniCode2Wav:
    """Build the codec decoder from a checkpoint directory's ``config.json`` (``code2wav_config``)
    on the CPU in ``dtype`` (default float32) and load its ``code2wav.`` tensors from the
    safetensors there (``Qwen3OmniCheckpoint.code2wav``)."""
    return _checkpoint(path).code2wav(CPU, dtype or torch.float32, dummy=False, seed=0)


class Qwen3OmniThinker(nn.Module):
    """The thinker's parts: the text decoder (``text``), the audio encoder (``audio_tower``)
    and the vision encoder (``visual``)."""

    def __init__(self, text: Qwen3OmniTextConfig, audio: Qwen3OmniAudioConfig,
                 vision: Qwen3OmniVisionConfig) -> None:
        super().__init__()
        self.text = Qwen3OmniThinkerForCausalLM(text)
        self.audio_tower = Qwen3OmniAudioEncoder(audio)
        self.visual = Qwen3OmniVisionEncoder(vision)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3OmniThinker:
        """From a whole Omni (``thinker_config``) or a thinker ``config.json`` dict."""
        return cls(Qwen3OmniTextConfig.from_hf_dict(d), Qwen3OmniAudioConfig.from_hf_dict(d),
                   Qwen3OmniVisionConfig.from_hf_dict(d))

    def use_fused_kernels(self, enabled: bool = True) -> None:
        """The text decoder's ``use_fused_kernels`` (its MoE experts as Triton kernels); the
        encoders stay eager."""
        self.text.use_fused_kernels(enabled)


NOT_BUILT = ("talker.", "code2wav.")  # the thinker's loader skips them (the talker's: ``load_talker``)


def thinker_name(name: str) -> str | None:
    """Our name in ``Qwen3OmniThinker`` of a released key (``None``: a part not built here);
    unknown keys pass through unchanged, so ``load_weights`` reports them."""
    if name.startswith(NOT_BUILT):
        return None
    if name.startswith(AUDIO_TOWER):
        return "audio_tower." + name[len(AUDIO_TOWER):]
    if name.startswith(VISUAL):
        return "visual." + name[len(VISUAL):]
    if name.startswith(("thinker.model.", "thinker.lm_head.")):
        return "text." + stacked_name(name)[len(THINKER):]
    return name


def load_thinker(thinker: Qwen3OmniThinker, tensors: Iterable[tuple[str, torch.Tensor]],
                 dtype: torch.dtype | None = None) -> None:
    """Fill the thinker from released keys in one pass, with coverage both ways: every
    parameter filled, every ``thinker.`` key of a built part loaded."""
    load_weights(thinker, tensors, name_map=thinker_name, dtype=dtype)


def load_thinker_dir(path: str | Path, dtype: torch.dtype | None = None) -> Qwen3OmniThinker:
    """Build the thinker from a checkpoint directory's ``config.json`` on the CPU in ``dtype``
    (default float32) and load its safetensors (``model-*.safetensors``, the released layout;
    ``Qwen3OmniCheckpoint.thinker``)."""
    return _checkpoint(path).thinker(CPU, dtype or torch.float32, dummy=False, seed=0)


TALKER = "talker."


def talker_name(name: str) -> str | None:
    """Our name in ``Qwen3OmniTalker`` of a released key (``None``: the thinker's or code2wav's);
    unknown keys pass through unchanged, so ``load_weights`` reports them."""
    if name.startswith((THINKER, "code2wav.")):
        return None
    name = stacked_name(name)
    return name[len(TALKER):] if name.startswith(TALKER) else name


def load_talker(talker: Qwen3OmniTalker, tensors: Iterable[tuple[str, torch.Tensor]],
                dtype: torch.dtype | None = None) -> None:
    """Fill the talker (decoder, projections, codec head, code predictor) from the released
    ``talker.`` keys, with coverage both ways."""
    load_weights(talker, tensors, name_map=talker_name, dtype=dtype)


def load_talker_dir(path: str | Path, dtype: torch.dtype | None = None) -> Qwen3OmniTalker:
    """Build the talker from a checkpoint directory's ``config.json`` (``talker_config``) on the
    CPU in ``dtype`` (default float32) and load its safetensors (``Qwen3OmniCheckpoint.talker``)."""
    return _checkpoint(path).talker(CPU, dtype or torch.float32, dummy=False, seed=0)


def _checkpoint(path: str | Path) -> Qwen3OmniCheckpoint:
    """The directory ``path`` as a checkpoint (the ``load_*_dir`` helpers: no hub lookup)."""
    return Qwen3OmniCheckpoint(Path(path))


# what a dummy deployment reads of a hub checkpoint: its configs and tokenizer, not its weights
CONFIG_FILES = ("*.json", "*.txt", "*.jinja", "tokenizer*")


@dataclass(frozen=True)
class Qwen3OmniCheckpoint:
    """A Qwen3-Omni checkpoint directory in the released layout (``config.json`` with
    ``thinker_config`` / ``talker_config`` / ``code2wav_config``, the tokenizer, the
    ``model-*.safetensors`` shards), and its parts built from it: each with the checkpoint's
    tensors (coverage both ways) or, for ``load_format: dummy``, seeded random weights."""

    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None, *, dummy: bool = False) -> Qwen3OmniCheckpoint:
        """``model_path`` (a directory, or a hub id resolved in the cache; with ``dummy`` only its
        config and tokenizer files are fetched)."""
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir, allow_patterns=CONFIG_FILES if dummy else None)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (expected a Qwen3-Omni checkpoint directory)")
        return cls(Path(path))

    def hf_config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def generation_eos(self) -> list[int]:
        """``eos_token_id`` of ``generation_config.json``, if any."""
        return generation_eos(self.path)

    def _tensors(self):
        return iter_safetensors(self.path)

    def thinker(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> Qwen3OmniThinker:
        from mstar.model.weights import building, fill_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            thinker = Qwen3OmniThinker.from_hf_dict(self.hf_config())
        return fill_weights(thinker, self._tensors, dummy=dummy, seed=seed, dtype=dtype, name_map=thinker_name)

    def talker(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> Qwen3OmniTalker:
        from mstar.model.weights import building, fill_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            talker = Qwen3OmniTalker.from_hf_dict(self.hf_config())
        return fill_weights(talker, self._tensors, dummy=dummy, seed=seed, dtype=dtype, name_map=talker_name)

    def code2wav(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> Qwen3OmniCode2Wav:
        from mstar.model.weights import building, fill_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            decoder = Qwen3OmniCode2Wav(Qwen3OmniCode2WavConfig.from_hf_dict(self.hf_config()))
        return fill_weights(decoder, self._tensors, dummy=dummy, seed=seed, dtype=dtype, name_map=code2wav_name)
