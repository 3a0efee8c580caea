"""Where the FastConformer encoder's time goes (S6's shapes, CUDA): the forward's wall time,
per-module CUDA-event times summed over the layers, the top kernels, and optionally
transformers' ``ParakeetEncoder`` and ``torch.compile`` of ours at the same batch.

    python3 benchmarks/profile_fastconformer.py --batch 32 [--transformers] [--compile]

Random bf16 weights at parakeet-tdt-0.6b-v3's encoder config, 30 s of log-mel frames a clip.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.s6_parakeet import PARAKEET_TDT_V3
from mstar.model.fastconformer.config import FastConformerConfig
from mstar.model.fastconformer.encoder import FastConformerEncoder

PARTS = ("feed_forward1", "self_attn", "conv", "feed_forward2")


def median_ms(fn, runs: int = 5) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def module_times(encoder: FastConformerEncoder, run) -> dict[str, float]:
    """CUDA time of the subsampling and of each conformer part, summed over the layers."""
    events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    handles = []

    def watch(name: str, module: torch.nn.Module) -> None:
        def before(m, args):
            m._start = torch.cuda.Event(enable_timing=True)
            m._start.record()

        def after(m, args, out):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((name, m._start, end))

        handles.extend([module.register_forward_pre_hook(before), module.register_forward_hook(after)])

    watch("subsampling", encoder.subsampling)
    for layer in encoder.layers:
        for part in PARTS:
            watch(part, getattr(layer, part))
    run()
    torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for name, start, end in events:
        totals[name] += start.elapsed_time(end)
    for handle in handles:
        handle.remove()
    return {k: round(v, 2) for k, v in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--frames", type=int, default=3000, help="log-mel frames a clip (100 a second)")
    parser.add_argument("--transformers", action="store_true", help="also time transformers' ParakeetEncoder")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of ours")
    args = parser.parse_args()
    device = torch.device("cuda")
    encoder_config = PARAKEET_TDT_V3["encoder_config"]
    config = FastConformerConfig.from_hf_dict(dict(encoder_config, model_type="parakeet_encoder"))
    encoder = FastConformerEncoder(config).to(device, torch.bfloat16).eval()
    mel = torch.randn(args.batch, args.frames, config.num_mel_bins, device=device, dtype=torch.bfloat16)
    lengths = torch.full((args.batch,), args.frames, device=device)
    with torch.inference_mode():
        run = lambda: encoder(mel, lengths)  # noqa: E731
        print(f"ours, batch {args.batch}: {median_ms(run):.1f} ms")
        times = module_times(encoder, run)
        print(f"per module (ms, summed over layers): {times}; sum {sum(times.values()):.1f}")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=90))
        if args.transformers:
            from transformers import ParakeetEncoder, ParakeetEncoderConfig

            reference = ParakeetEncoder(ParakeetEncoderConfig(**encoder_config)).to(device, torch.bfloat16).eval()
            mask = torch.ones(args.batch, args.frames, dtype=torch.long, device=device)
            ms = median_ms(lambda: reference(input_features=mel, attention_mask=mask))
            print(f"transformers ParakeetEncoder, batch {args.batch}: {ms:.1f} ms")
            del reference
        if args.compile:
            start = time.perf_counter()
            compiled = torch.compile(encoder, dynamic=False)
            compiled(mel, lengths)
            torch.cuda.synchronize()
            print(f"torch.compile: {time.perf_counter() - start:.0f} s to compile, "
                  f"{median_ms(lambda: compiled(mel, lengths)):.1f} ms a forward")


if __name__ == "__main__":
    main()
