"""A whole Whisper large-v3 decoder step (bf16, 32 layers, random weights, ``fused_kernels``
on, Triton attention, one cross-attention slot of 1500 frames per sequence), captured in a
CUDA graph, under two paths for the decoder layers: ``gemv`` (``forward_gemv`` up to
``DECODE_GEMV_ROWS`` rows: eight kernels a layer) and ``fused`` (``forward_fused`` as before
it: add + LayerNorm kernels, cuBLAS, GELU, cache writes, split combines), at several row
counts (one sequence per row).

Each sequence has ``--context`` tokens cached (random keys and values) and decodes one; the
step ends with the final norm (no logits: they do not depend on the path). Printed per row
count: milliseconds per replayed step under each path (median of ``--replays``), the saving,
and the hidden states' difference between the two (max error relative to the largest: the
same function, so bf16 rounding only). On an H200, in about a minute:

    python benchmarks/check_whisper_step.py --rows 1 2 4
    python benchmarks/check_whisper_step.py --smoke   # tiny shapes on the CPU: the GEMVs under
                                                      # Triton's interpreter, torch attention

First run on an H100 on 2026-12-07: 2.07 against 2.09 ms a step at one row (docs/benchmarks.md, S4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import time_calls

LARGE_V3 = dict(vocab_size=51866, num_mel_bins=128, d_model=1280, encoder_layers=1, encoder_attention_heads=20,
                decoder_layers=32, decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120,
                max_source_positions=1500, max_target_positions=448)
TINY = dict(vocab_size=120, num_mel_bins=8, d_model=32, encoder_layers=1, encoder_attention_heads=4,
            decoder_layers=2, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_source_positions=24, max_target_positions=64)
PAGE_SIZE = 16


def build(config: dict, device: torch.device, dtype: torch.dtype):
    from mstar.model.whisper.config import WhisperConfig
    from mstar.model.whisper.modeling import WhisperForConditionalGeneration

    torch.manual_seed(0)
    with torch.device(device):
        model = WhisperForConditionalGeneration(WhisperConfig(**config))
    model = model.to(dtype).eval()
    model.use_fused_kernels()
    return model


def step_inputs(model, rows: int, context: int, device: torch.device, dtype: torch.dtype, backend: str):
    """``(ids, meta, kv_caches, cross_caches, cross)`` of a decode step of ``rows`` sequences,
    each with ``context`` cached tokens and its own cross-attention slot."""
    from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
    from mstar.model.whisper.cross_kv import CrossAttentionBatch, CrossKVSlots

    layers, heads, head_dim = model.kv_layout()
    frames = model.config.max_source_positions
    width = -(-model.config.max_target_positions // PAGE_SIZE)  # a graph bucket's page table
    pages_each = -(-(context + 1) // PAGE_SIZE)
    kv = allocate_kv_cache(layers, rows * width + 1, PAGE_SIZE, heads, head_dim, dtype, device)
    for cache in kv:
        cache.normal_()
    cross = CrossKVSlots(layers, rows, frames, heads, head_dim, dtype, device)
    cross.buffer[:, :, :rows].normal_()
    table = torch.zeros(rows, width, dtype=torch.int64)
    for b in range(rows):
        table[b, :pages_each] = torch.arange(b * width, b * width + pages_each) + 1
    positions = torch.full((rows,), context, dtype=torch.int64)
    slot_mapping = table[torch.arange(rows), context // PAGE_SIZE] * PAGE_SIZE + context % PAGE_SIZE
    meta = PagedAttentionMetadata(positions.to(device), slot_mapping.to(device),
                                  torch.arange(rows + 1, device=device), (positions + 1).to(device), table.to(device),
                                  PAGE_SIZE, backend)
    slots = torch.arange(rows, device=device)
    batch = CrossAttentionBatch.build(slots, None, frames=frames, sink=cross.sink, backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
    return ids.to(device), meta, kv, cross.layers, batch


def run_path(model, path: str, inputs, graph: bool, replays: int) -> tuple[float, torch.Tensor]:
    """Milliseconds per step (median of ``replays`` graph replays; 0 without a graph) and the
    step's hidden states, the decoder layers on ``path``."""
    from mstar.model.whisper import modeling

    saved = modeling.DECODE_GEMV_ROWS
    modeling.DECODE_GEMV_ROWS = saved if path == "gemv" else 0
    try:
        with torch.no_grad():
            step = lambda: model.decode(*inputs)  # noqa: E731
            out = step()  # the warm-up (one-time buffers, compiles)
            if not graph:
                return 0.0, out
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = step()
            return 1e3 * statistics.median(time_calls(g.replay, "cuda", replays, warmup=0)), out.clone()
    finally:
        modeling.DECODE_GEMV_ROWS = saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype, config, graph = torch.device("cpu"), torch.float32, TINY, False
        backend = "torch"  # the interpreter's attention loops need a test-only patch (test_whisper_triton.py)
        args.context = min(args.context, 20)
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 1
    else:
        device, dtype, config, graph, backend = torch.device("cuda"), torch.bfloat16, LARGE_V3, True, "triton"
    model = build(config, device, dtype)
    worst = 0.0
    for rows in args.rows:
        inputs = step_inputs(model, rows, args.context, device, dtype, backend)
        fused_ms, fused_out = run_path(model, "fused", inputs, graph, args.replays)
        gemv_ms, gemv_out = run_path(model, "gemv", inputs, graph, args.replays)
        err = ((gemv_out.float() - fused_out.float()).abs().max() / fused_out.float().abs().max()).item()
        worst = max(worst, err)
        saving = f"{100 * (fused_ms - gemv_ms) / fused_ms:+.1f}%" if graph else "-"
        print(f"rows {rows}: fused {fused_ms:.3f} ms, gemv {gemv_ms:.3f} ms ({saving}), hidden rel. err {err:.1e}")
    limit = 2e-2 if dtype == torch.bfloat16 else 1e-5
    if worst > limit:
        print(f"the paths differ by {worst:.1e} > {limit:.0e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
