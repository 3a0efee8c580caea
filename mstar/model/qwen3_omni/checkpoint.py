"""Qwen3-Omni's released key layout onto our modules.

The released checkpoint holds the whole model under four prefixes: ``thinker.`` (``model``:
the text decoder, ``audio_tower``, ``visual``, ``lm_head``), ``talker.``, ``code2wav.`` and
the talker's code predictor inside ``talker.``. Experts are stored apart
(``mlp.experts.{i}.gate_proj.weight`` ...); ``load_weights`` stacks them (``SparseMoE``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mstar.model.qwen3_omni.modeling import Qwen3OmniThinkerForCausalLM
from mstar.model.weights import load_weights

THINKER = "thinker."
# what the thinker's text decoder does not load: the other components and the thinker's encoders
NOT_TEXT = ("thinker.audio_tower.", "thinker.visual.", "talker.", "code2wav.")


def thinker_text_name(name: str) -> str | None:
    """Our name in ``Qwen3OmniThinkerForCausalLM`` of a released checkpoint key (``None``: a
    key of another component, skipped). Keys outside the known prefixes pass through unchanged,
    so ``load_weights`` reports them."""
    if name.startswith(NOT_TEXT):
        return None
    return name[len(THINKER):] if name.startswith(THINKER) else name


def load_thinker_text(model: Qwen3OmniThinkerForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]],
                      dtype: torch.dtype | None = None) -> None:
    """Fill the thinker's text decoder from released keys, with two-way coverage."""
    load_weights(model, tensors, name_map=thinker_text_name, dtype=dtype)


AUDIO_TOWER = "thinker.audio_tower."


def audio_tower_name(name: str) -> str | None:
    """Our name in ``Qwen3OmniAudioEncoder`` of a released key (``None``: another part's)."""
    return name[len(AUDIO_TOWER):] if name.startswith(AUDIO_TOWER) else None


def load_audio_tower(encoder: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                     dtype: torch.dtype | None = None) -> None:
    """Fill the audio encoder from the released ``thinker.audio_tower.`` keys (every parameter
    must be filled, and every such key must load)."""
    load_weights(encoder, tensors, name_map=audio_tower_name, dtype=dtype)
