"""NeMo ``ConformerEncoder`` parameter names as ours (the layout transformers' Parakeet converter
gives): the conformer layers' renames, which every NeMo checkpoint shares, after the renames of
the family's own subsampling front (the dw-striding one of Canary-Qwen, VoiceChat's causal one)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

LAYER_RENAMES = (
    (r"^(layers\.\d+)\.conv\.batch_norm\.", r"\1.conv.norm."),
    (r"\.linear_([qkv])\.", r".\1_proj."), (r"\.linear_out\.", ".o_proj."),
    (r"\.linear_pos\.", ".relative_k_proj."), (r"\.pos_bias_([uv])$", r".bias_\1"))


def conformer_renamer(subsampling: Sequence[tuple[str, str]]) -> Callable[[str], str]:
    """A NeMo encoder parameter name (under the encoder) as ours: ``subsampling``'s
    ``(pattern, replacement)`` renames, then the layers'."""
    rules = [(re.compile(p), r) for p, r in (*subsampling, *LAYER_RENAMES)]

    def rename(name: str) -> str:
        for pattern, replacement in rules:
            name = pattern.sub(replacement, name)
        return name

    return rename
