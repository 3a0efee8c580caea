"""Where a FLUX.2 LoRA lands in ``Flux2Transformer``: adapters in diffusers/PEFT names target
our modules as they are; adapters in BFL's original layout (``double_blocks.N.img_attn.qkv``,
``single_blocks.N.linear1``, ...) are renamed, a fused ``qkv`` update split into its q, k and
v thirds."""

from __future__ import annotations

import re

_DOUBLE = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.linear_in",),
    "img_mlp.2": ("ff.linear_out",),
    "txt_mlp.0": ("ff_context.linear_in",),
    "txt_mlp.2": ("ff_context.linear_out",),
}
_SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}
_TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
}
_BLOCK = re.compile(r"^(double|single)_blocks\.(\d+)\.(.+)$")


def flux2_lora_targets(name: str) -> list[tuple[str, int, int]]:
    """The ``Flux2Transformer`` modules an adapter module ``name`` updates, as
    ``(module, chunk, chunks)`` for ``mstar.model.lora.fold_adapter``."""
    if name in _TOP:
        return [(_TOP[name], 0, 1)]
    match = _BLOCK.match(name)
    if match is None:
        return [(name, 0, 1)]  # diffusers / PEFT names are ours
    kind, index, rest = match.groups()
    if kind == "single":
        return [(f"single_transformer_blocks.{index}.{_SINGLE.get(rest, rest)}", 0, 1)]
    parts = _DOUBLE.get(rest, (rest,))
    return [(f"transformer_blocks.{index}.{part}", i, len(parts)) for i, part in enumerate(parts)]
