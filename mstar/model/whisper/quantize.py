"""``model_kwargs.quantization`` for Whisper: which layers run as int8, and with which kernel.

``int8`` rounds the layers a decode step runs to weight-only int8 (one symmetric scale per
output row: ``mstar.layers.quantized.int8_weight``, our float32 kernel where it builds, else
``aten._weight_int8pack_mm`` over bfloat16 activations),
through the project's ``mstar.model.quantize`` after the weights load; the modeling file stays
the float reference:

* every decoder layer's self-attention q/k/v/out, cross-attention q/out, fc1 and fc2;
* the tied output projection (a quantised copy of the token embedding's rows for the logits;
  the lookups keep the float rows).

Left float: the convolution front end, the position and token embeddings' lookups, the
encoder, and the cross-attention k/v projections (run once per request over the 1500 audio
frames). Why, measured on the 2-core CPU benchmark machine (Xeon, AVX-512 with VNNI and AMX,
torch 2.13, 2 threads; ms per product, one run while the machine was otherwise idle; the
products of ``benchmarks/int8_linear_cpu.py``, which reproduces them):

=============================  ========  ================  ============
shape (M x K x N)              float32   weight-only int8  dynamic int8
=============================  ========  ================  ============
1500 x 512 x 512 (encoder)     2.1       5.0               2.2
1500 x 512 x 2048 (enc. fc1)   7.6       19.3              23.3
1500 x 2048 x 512 (enc. fc2)   8.2       17.2              6.3
1 x 512 x 2048 (dec. fc1)      0.053     0.038             0.069
1 x 2048 x 512 (dec. fc2)      0.048     0.036             0.057
1 x 512 x 51865 (logits)       2.3       0.93              1.9
=============================  ========  ================  ============

A decode step multiplies one row per sequence by every weight: it is bound by the bytes it
reads, and int8 weights read a quarter of float32's. Weight-only int8 is the faster of the two
int8 products there (the dynamic one, ``torch._int_mm`` with per-row activation scales, pays
for rounding the activations and its int32 output at one row, and is slower than float32 for
the small matrices). Over 1500 rows the products are bound by arithmetic instead, and neither
int8 kernel beats oneDNN's float32 GEMM overall: weight-only int8 is 2-2.5x slower, the dynamic
one is slower for ``fc1`` (3x) and faster only for ``fc2`` (and, in some later runs on a busy
machine, for the 512 x 512 projections: 1.0 against 2.4 ms), so the encoder and the per-request
cross K/V stay float32. A mixed encoder (dynamic int8 where it wins) is left for later.

``w8a8`` quantises every linear layer, the encoder's and the cross-attention k/v too, as int8 x
int8 products (``W8A8Weight``: activations rounded to int8 per row at every call), as
CTranslate2's int8 mode does. On the 2-core AMD EPYC VM of 2026-12-05 (AVX-512 with VNNI, no
AMX) fbgemm's int8 GEMM beat oneDNN's float32 one ~3x at the encoder's shapes (1500 x 512 x
2048: 5.2 against 16.8 ms; 1500 x 2048 x 512: 6.0 against 15.8), and whisper_base with
``w8a8`` transcribed the 8.7 s clip at 12.9x real time against 10.0x with ``int8`` (decoder
only) and CTranslate2 int8's 12.3x, the same text; its logits move further from float32's
(4.4e-2 relative against 1.7e-2, ``tests/model/test_whisper_int8.py``).
"""

from __future__ import annotations

from torch import nn

from mstar.model.quantize import quantize_model

__all__ = ["WHISPER_QUANTIZATIONS", "quantize_whisper"]

WHISPER_QUANTIZATIONS = ("none", "int8", "w8a8")

_ONCE_PER_REQUEST = ("encoder_attn.k_proj", "encoder_attn.v_proj")  # over the audio frames


def per_token_layer(name: str) -> bool:
    """Whether the module ``name`` of a ``WhisperForConditionalGeneration`` runs at every
    decode step (the decoder's layers and its tied embedding)."""
    return name.startswith("model.decoder.") and not name.endswith(_ONCE_PER_REQUEST)


def quantize_whisper(model: nn.Module, mode: str) -> list[str]:
    """Quantise ``model`` (a loaded ``WhisperForConditionalGeneration``) in place for
    ``mode`` (one of ``WHISPER_QUANTIZATIONS``); the names of the layers quantised."""
    if mode not in WHISPER_QUANTIZATIONS:
        raise ValueError(f"Whisper's quantization must be one of {', '.join(WHISPER_QUANTIZATIONS)}, got {mode!r}")
    where = every_linear if mode == "w8a8" else per_token_layer
    return quantize_model(model, mode, logits_from_embeddings=True, where=where)


def every_linear(name: str) -> bool:
    """``w8a8``'s choice: the encoder's and the cross-attention's layers too (see the module's
    docstring), all but the convolution front end, which is not a linear layer."""
    return name.startswith(("model.encoder.", "model.decoder."))
