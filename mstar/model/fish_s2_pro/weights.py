"""Fish's dual-AR parameter names onto ``DualAR``'s.

The released model keeps fish-speech's names: per layer a fused ``attention.wqkv`` (q, k, v
rows), ``attention.wo``, ``attention.q_norm`` / ``k_norm``, ``feed_forward.w1`` (gate),
``w3`` (up), ``w2`` (down), ``attention_norm`` and ``ffn_norm``; ``embeddings``,
``codebook_embeddings``, ``norm`` and ``output`` (absent when tied) for the slow AR, and
``fast_*`` for the fast AR. fish-speech's RoPE rotates interleaved channel pairs; the rows of
q and k (and their norm weights) are permuted here into the half-split layout
``mstar.layers.rotary`` rotates, which leaves every attention score unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mstar.model.fish_s2_pro.config import DualARConfig


def interleaved_to_half(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows (dim 0) of ``t``, in blocks of ``head_dim``, reordered even channels first, then odd."""
    perm = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    blocks = t.reshape(-1, head_dim, *t.shape[1:])
    return blocks[:, perm].reshape(t.shape)


def _layer(prefix: str, ours: str, heads: int, kv_heads: int, head_dim: int,
           tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    def take(name: str) -> torch.Tensor:
        return tensors.pop(prefix + name)

    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    q, k, v = take("attention.wqkv.weight").split([q_rows, kv_rows, kv_rows])
    yield ours + "self_attn.qkv_proj.weight", torch.cat(
        (interleaved_to_half(q, head_dim), interleaved_to_half(k, head_dim), v))
    yield ours + "self_attn.o_proj.weight", take("attention.wo.weight")
    for norm in ("q_norm", "k_norm"):
        if prefix + f"attention.{norm}.weight" in tensors:
            yield ours + f"self_attn.{norm}.weight", interleaved_to_half(take(f"attention.{norm}.weight"), head_dim)
    yield ours + "mlp.gate_up_proj.weight", torch.cat((take("feed_forward.w1.weight"), take("feed_forward.w3.weight")))
    yield ours + "mlp.down_proj.weight", take("feed_forward.w2.weight")
    yield ours + "input_layernorm.weight", take("attention_norm.weight")
    yield ours + "post_attention_layernorm.weight", take("ffn_norm.weight")


def s1_names(released: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """S2's names (``text_model.model.*`` for the slow AR, ``audio_decoder.*`` for the fast
    AR and the codebook embeddings) in the flat fish-speech form; other names as they are."""
    out = {}
    for name, tensor in released.items():
        if name.startswith("text_model.model."):
            name = name[len("text_model.model."):]
        elif name.startswith("audio_decoder."):
            rest = name[len("audio_decoder."):]
            name = rest if rest.startswith("codebook_embeddings.") else "fast_" + rest
        out[name] = tensor
    return out


def dual_ar_tensors(config: DualARConfig, released: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``DualAR``'s state dict from the released tensors (left untouched), in either naming
    (``s1_names``). A released tensor that nothing here takes raises, naming it: the coverage
    check's released side."""
    c, tensors, out = config, s1_names(released), {}
    for i in range(c.n_layer):
        out.update(_layer(f"layers.{i}.", f"slow.layers.{i}.", c.n_head, c.n_local_heads, c.head_dim, tensors))
    for i in range(c.n_fast_layer):
        assert c.fast_n_head and c.fast_n_local_heads and c.fast_head_dim
        out.update(_layer(f"fast_layers.{i}.", f"fast.fast_layers.{i}.", c.fast_n_head, c.fast_n_local_heads,
                          c.fast_head_dim, tensors))
    for name in ("embeddings.weight", "codebook_embeddings.weight", "norm.weight", "output.weight"):
        if name in tensors:
            out["slow." + name] = tensors.pop(name)
    for name in ("fast_project_in.weight", "fast_project_in.bias", "fast_embeddings.weight", "fast_norm.weight",
                 "fast_output.weight"):
        if name in tensors:
            out["fast." + name] = tensors.pop(name)
    if tensors:
        raise KeyError(f"released tensors with no place in the model: {sorted(tensors)[:8]}")
    return out


CODEC_ENCODER_SIDE = ("encoder.", "quantizer.downsample.", "quantizer.pre_module.", "quantizer.semantic_predictor")


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``g * v / |v|``, the norm over every dim but the first (``weight_norm(dim=0)``)."""
    norm = v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
    return g * v / norm


def _folded(released: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, pending = {}, {}
    for name, tensor in released.items():
        for suffix, part in ((".parametrizations.weight.original0", "g"), (".parametrizations.weight.original1", "v"),
                             (".weight_g", "g"), (".weight_v", "v")):
            if name.endswith(suffix):
                pending.setdefault(name[: -len(suffix)] + ".weight", {})[part] = tensor
                break
        else:
            out[name] = tensor
    for name, parts in pending.items():
        out[name] = fold_weight_norm(parts["g"], parts["v"])
    return out


def codec_encoder_tensors(released: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """``CodecEncoder``'s state dict from the released codec tensors (weight norm folded): the
    encoder side and the codebooks; an encoder-side tensor with no place raises, naming it."""
    out = {name: t for name, t in _folded(released).items() if name in expected}
    extra = sorted(name for name in _folded(released)
                   if name not in expected and (name.startswith(CODEC_ENCODER_SIDE) or ".in_proj." in name))
    if extra:
        raise KeyError(f"released codec encoder tensors with no place in the encoder: {extra[:8]}")
    return out


def codec_tensors(released: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """``CodecDecoder``'s state dict from the released codec tensors: weight norm folded (either
    the ``parametrizations.weight.original0/1`` or the ``weight_g/weight_v`` spelling), the
    encoder side (used only to encode reference audio) left out. A decoder-side tensor with no
    place in ``expected`` raises, naming it."""
    out, pending = {}, {}
    for name, tensor in released.items():
        if name.startswith(CODEC_ENCODER_SIDE) or ".in_proj." in name:
            continue
        for suffix, part in ((".parametrizations.weight.original0", "g"), (".parametrizations.weight.original1", "v"),
                             (".weight_g", "g"), (".weight_v", "v")):
            if name.endswith(suffix):
                pending.setdefault(name[: -len(suffix)] + ".weight", {})[part] = tensor
                break
        else:
            out[name] = tensor
    for name, parts in pending.items():
        out[name] = fold_weight_norm(parts["g"], parts["v"])
    extra = sorted(set(out) - expected)
    if extra:
        raise KeyError(f"released codec tensors with no place in the decoder: {extra[:8]}")
    return out
