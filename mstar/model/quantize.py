"""Weight-only quantisation of a loaded model, applied from outside (``model_kwargs.quantization``).

The modeling files stay the float reference: after the weights load, ``quantize_model`` walks
the module tree and gives each linear layer (``mstar.layers.linear``) a quantised matrix in
its ``qweight`` (``mstar.layers.quantized``), whose product then replaces the float GEMM;
the float weight of a quantised linear is dropped. A plain ``torch.nn.Linear`` (a model built
without the project's layers, such as Whisper) is replaced in its parent by a
``QuantizedLinear`` holding the quantised matrix and the bias. ``where`` picks the layers by
name (Whisper keeps the layers that run over its 1500 audio frames float). Modes:

* ``none``: float weights, as loaded (a GGUF checkpoint dequantised).
* ``int8``: every linear rounded to int8, one scale per output row.
* ``w8a8``: every linear rounded to int8 (one scale per output row) and its activations
  rounded to int8 at every call (one scale per row of the batch), an int8 x int8 product
  (``W8A8Weight``). A GGUF checkpoint's blocks are dequantised first, so its Q4_0/Q4_1 weights
  are rounded twice (to the file's 4-bit grid, then to a per-row int8 grid: the second step
  adds at most half a step of ``max|row| / 127``, about 1% of the row's norm for a Gaussian
  row); Q8_0 codes with a per-32 scale likewise.
* ``int4``: every linear rounded to 4 bits in groups of 32 input features (scale and offset
  per group).
* ``gguf``: the GGUF file's own blocks kept as they are stored (``GGUFBlocks``): Q4_0 and
  Q4_1 as int4 with the file's scales and offsets, Q8_0 as two int4 halves (exact codes).
  Matrices stored in other types (F32, F16, K-quants) stay float, and the log says so.

Tied logits: with ``logits_from_embeddings`` the token embedding gets a quantised copy for
the logits, keeping its float rows for the lookups (one row per token: cheap).

The kernels are PyTorch's CPU ones, so quantisation is for CPU deployments; a layer split
over tensor-parallel ranks is refused (its blocks would need splitting too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from mstar.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from mstar.layers.quantized import (
    INT4_GROUP_SIZE,
    QuantizedLinear,
    QuantizedWeight,
    W8A8Weight,
    int4_weight,
    int8_weight,
    q8_weight,
    quantized_kernels_available,
    round_int4,
    w8a8_kernel_available,
)

if TYPE_CHECKING:  # the GGUF reader (gguf, tokenizers) loads only where a GGUF file is read
    from mstar.model.gguf_loader import GGUFBlocks

__all__ = ["QUANTIZATIONS", "quantize_model"]

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8", "int4", "gguf", "w8a8")

_LINEARS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def quantize_model(model: nn.Module, mode: str, *, blocks: Iterable[tuple[str, GGUFBlocks]] = (),
                   logits_from_embeddings: bool = False, where: Callable[[str], bool] | None = None) -> list[str]:
    """Quantise ``model``'s linear layers in place (``mode``: one of ``QUANTIZATIONS``); the
    names of the layers quantised. ``blocks``: ``(checkpoint name, GGUFBlocks)`` of the
    checkpoint, for ``mode="gguf"`` (names as ``load_weights`` takes them; a fused layer's
    segments are found by their ``segment_names``). ``where``: only the layers (and the tied
    embedding) whose module name it accepts; default all."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "none":
        return []
    if mode == "w8a8" and not w8a8_kernel_available():
        raise RuntimeError(f"quantization w8a8 needs fbgemm's int8 CPU linear, which this torch "
                           f"{torch.__version__} lacks")
    if mode != "w8a8" and not quantized_kernels_available():
        raise RuntimeError(f"quantization {mode!r} needs PyTorch's int4/int8 CPU kernels, which torch "
                           f"{torch.__version__} lacks")
    stored = dict(blocks)
    done, kept = [], []
    plain = []  # (name, nn.Linear): replaced once the walk is over
    for name, module in model.named_modules():
        if where is not None and not where(name):
            continue
        if type(module) is nn.Linear:
            plain.append((name, module))
            continue
        is_embedding = isinstance(module, VocabParallelEmbedding)
        if not (isinstance(module, _LINEARS) or (is_embedding and logits_from_embeddings)):
            continue
        if module.tp.size > 1:
            raise ValueError(f"{name}: quantization needs the layer on one rank (tp_size 1)")
        weight = _gguf_weight(name, module, stored) if mode == "gguf" else _rounded(module.weight, mode)
        if weight is None:
            kept.append(name)
            continue
        module.qweight = weight
        if not is_embedding:  # the product no longer reads it
            module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)
        done.append(name)
    for name, module in plain:
        weight = None if mode == "gguf" else _rounded(module.weight, mode)
        if weight is None:  # gguf: plain layers are not a GGUF model's; int4: not in whole groups
            kept.append(name)
            continue
        parent, _, leaf = name.rpartition(".")
        model.get_submodule(parent).register_module(leaf, QuantizedLinear(weight, module.bias))
        done.append(name)
    if kept:
        log.info("quantization %s: %d layer(s) stay float (%s)", mode, len(kept), ", ".join(kept[:4]))
    log.info("quantization %s: %d layer(s) quantised", mode, len(done))
    return done


def _rounded(weight: torch.Tensor, mode: str) -> QuantizedWeight | None:
    if mode == "int8":
        return int8_weight(weight)
    if mode == "w8a8":
        return W8A8Weight.quantize(weight)
    if weight.shape[1] % INT4_GROUP_SIZE:
        return None
    return int4_weight(*round_int4(weight))


def _gguf_weight(name: str, module: nn.Module, stored: dict[str, GGUFBlocks]) -> QuantizedWeight | None:
    """The stored blocks of ``module``'s weight (every segment's, stacked), or None when the
    file does not store them all in one block format."""
    segments = getattr(module, "segment_names", None)
    parent = name.rpartition(".")[0]
    names = [f"{parent}.{s}.weight" if parent else f"{s}.weight" for s in segments] if segments else [f"{name}.weight"]
    parts = [stored.get(n) for n in names]
    if any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
        return None
    from mstar.model.gguf_loader import GGUFBlocks

    b = parts[0] if len(parts) == 1 else GGUFBlocks(
        parts[0].kind, torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
        None if parts[0].offset is None else torch.cat([p.offset for p in parts]))
    if b.kind == "q8":
        return q8_weight(b.codes, b.scale)
    return int4_weight(b.codes, b.scale, b.offset)
