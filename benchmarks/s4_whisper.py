"""S4: Whisper large-v3 speech recognition: real-time factor of 30 s clips, against transformers.

Whisper-large-v3 shapes (32 encoder + 32 decoder layers, d_model 1280, 20 heads, FFN 5120,
128 mel bins, vocabulary 51866), random ("dummy") weights, bf16 on one GPU. Every clip is
30 s of random audio and is decoded for exactly 100 tokens (EOS ignored), greedy, in English
with no timestamps (prompt ``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``).

* **ours**: an in-process M* deployment of the ``whisper_large`` model: each clip's
  ``transcribe`` walk (encoder, decoder prefill, Loop of decodes) is built by the model's own
  ``window_request`` (log-mel on the CPU, outside the timing) and submitted straight to the
  runtime with EOS removed from its stop ids. N clips are submitted at once.
* **baseline**: transformers ``WhisperForConditionalGeneration.generate`` on the same config
  and precomputed features, ``min_new_tokens = max_new_tokens = 100`` (which masks EOS).
* **floor**: per clip batch, ``100 x`` the least decode step (decoder weight bytes over the
  measured bandwidth, or the FLOPs of N tokens over the matmul rate, whichever is larger)
  plus the encoder FLOPs (and the cross-attention K/V projection) over the matmul rate.

The metric is the real-time factor: audio seconds transcribed per wall second (higher is
better). ``--smoke`` runs the same code paths with a tiny model on the CPU in seconds.
See benchmarks/README.md for the command lines.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    WHISPER_LARGE_V3,
    WHISPER_TINY,
    Metric,
    TimedSink,
    add_run_args,
    hardware,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    setup_logging,
    synchronize,
    wait_all,
    whisper_dir,
    write_record,
)

NAME = "s4_whisper"
SCENARIO = "S4 whisper-large-v3"
SAMPLE_RATE = 16000
PAGE_SIZE = 16

log = logging.getLogger("s4")


@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    model: dict[str, Any]
    clip_s: float
    new_tokens: int
    batches: tuple[int, ...]
    warmup_tokens: int
    runs: int
    baseline_runs: int
    attention_backend: str | None = None  # model_kwargs.attention_backend of ours (None: the engine's)
    cuda_graphs: bool = False  # model_kwargs.cuda_graphs of ours
    overlap: bool = False  # model_kwargs.overlap_scheduling of ours
    fused_kernels: bool = False  # model_kwargs.fused_kernels of ours
    seed: int = 0

    @property
    def max_batch(self) -> int:
        return max(self.batches)

    def describe(self) -> dict[str, Any]:
        return {
            "smoke": self.smoke, "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
            "model": self.model, "clip_s": self.clip_s, "new_tokens": self.new_tokens,
            "batches": list(self.batches), "warmup_tokens": self.warmup_tokens, "runs": self.runs,
            "baseline_runs": self.baseline_runs, "attention_backend": self.attention_backend,
            "cuda_graphs": self.cuda_graphs, "overlap_scheduling": self.overlap,
            "fused_kernels": self.fused_kernels, "seed": self.seed, "sampling": "greedy",
            "ignore_eos": True, "prompt": "sot en transcribe notimestamps",
        }


def settings_from(args: argparse.Namespace) -> Settings:
    batches = tuple(sorted({int(b) for b in args.batches.split(",")})) if args.batches else None
    if args.smoke:
        device, dtype, model = "cpu", torch.float32, dict(WHISPER_TINY)
        new_tokens, batches = args.new_tokens or 8, batches or (1, 4)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S4 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, model = "cuda", torch.bfloat16, dict(WHISPER_LARGE_V3)
        new_tokens, batches = args.new_tokens or 100, batches or (1, 32)
    if not 2 <= new_tokens <= model["max_target_positions"] - 4:
        raise SystemExit(f"--new-tokens must be between 2 and {model['max_target_positions'] - 4}")
    return Settings(smoke=args.smoke, device=device, dtype=dtype, model=model, clip_s=args.clip_seconds,
                    new_tokens=new_tokens, batches=batches, warmup_tokens=min(args.warmup_tokens, new_tokens),
                    runs=args.runs, baseline_runs=args.baseline_runs, attention_backend=args.attention_backend,
                    cuda_graphs=args.cuda_graphs, overlap=args.overlap, fused_kernels=args.fused_kernels,
                    seed=args.seed)


# --------------------------------------------------------------------------- the bound
@dataclass(frozen=True)
class Roofline:
    """Whisper's cost model and the machine's measured limits."""

    bandwidth_gbs: float
    matmul_tflops: float
    decoder_bytes_per_step: int  # decoder weights a decode step reads (cross K/V projections excluded)
    decoder_flops_per_token: float
    clip_flops: float  # encoder (convolutions, layers, attention) + the decoder's cross K/V projection
    cross_kv_bytes_per_clip: int  # the cross-attention K/V every decode step reads, per clip

    @classmethod
    def of(cls, m: dict[str, Any], dtype: torch.dtype, bandwidth_gbs: float, matmul_tflops: float,
           frames: int) -> Roofline:
        d, size = m["d_model"], torch.finfo(dtype).bits // 8
        dec_layers, enc_layers = m["decoder_layers"], m["encoder_layers"]
        dec_matmul = dec_layers * (4 * d * d + 2 * d * d + 2 * d * m["decoder_ffn_dim"]) + m["vocab_size"] * d
        dec_small = dec_layers * (3 * 2 * d + 9 * d + m["decoder_ffn_dim"]) + 2 * d  # norms and biases
        positions = frames // 2
        encoder = (2 * frames * 3 * m["num_mel_bins"] * d + 2 * positions * 3 * d * d
                   + enc_layers * (2 * positions * (4 * d * d + 2 * d * m["encoder_ffn_dim"]) + 4 * positions**2 * d))
        cross_kv = 2 * positions * 2 * d * d * dec_layers
        return cls(bandwidth_gbs=bandwidth_gbs, matmul_tflops=matmul_tflops,
                   decoder_bytes_per_step=(dec_matmul + dec_small) * size,
                   decoder_flops_per_token=2.0 * dec_matmul, clip_flops=float(encoder + cross_kv),
                   cross_kv_bytes_per_clip=2 * dec_layers * positions * d * size)

    def batch_seconds(self, clips: int, tokens: int, with_cross_kv: bool = False) -> float:
        """Least time to transcribe ``clips`` clips of ``tokens`` tokens each."""
        read = self.decoder_bytes_per_step + (clips * self.cross_kv_bytes_per_clip if with_cross_kv else 0)
        compute = clips * self.decoder_flops_per_token / (self.matmul_tflops * 1e12)
        step = max(read / (self.bandwidth_gbs * 1e9), compute)
        return tokens * step + clips * self.clip_flops / (self.matmul_tflops * 1e12)


# ------------------------------------------------------------------------------- ours
class OursRunner:
    """An in-process M* deployment of ``whisper_large``, driven through its runtime."""

    def __init__(self, settings: Settings, model_dir: Path):
        import mstar.model.whisper.model  # noqa: F401  (registers the whisper families)
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        self.settings = settings
        pages = -(-(4 + settings.new_tokens) // PAGE_SIZE)
        model_kwargs: dict[str, Any] = {"max_new_tokens": settings.new_tokens, "seed": settings.seed,
                                        "cuda_graphs": settings.cuda_graphs,
                                        "overlap_scheduling": settings.overlap,
                                        "fused_kernels": settings.fused_kernels}
        if settings.attention_backend:
            model_kwargs["attention_backend"] = settings.attention_backend
        self.config = parse_config({
            "model": "whisper_large",
            "model_path": str(model_dir),
            "load_format": "dummy",
            "device": settings.device,
            "dtype": str(settings.dtype).removeprefix("torch."),
            "max_concurrent_requests": settings.max_batch,
            "resources": {"kv_cache": {"max_num_pages": settings.max_batch * pages, "page_size": PAGE_SIZE}},
            "model_kwargs": model_kwargs,
        }, "s4 config")
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.batches = 0
        self.deployment = start(self.config, in_process=True)

    def request(self, new_tokens: int):
        """One clip's walk, built by the model's own frontend, decoding ``new_tokens`` with EOS
        ignored (the only change to what a transcription request would run)."""
        s = self.settings
        samples = 0.1 * torch.randn(int(s.clip_s * SAMPLE_RATE), generator=self.generator)
        request = self.deployment.spec.window_request(samples, "en", "transcribe", None, 0.0, s.seed)
        request.params.update(max_new_tokens=new_tokens, max_decode_steps=new_tokens - 1, stop_token_ids=[])
        return request

    def run(self, clips: int, new_tokens: int, timeout_s: float = 900.0) -> float:
        """Submit ``clips`` clips at once; returns the wall time until the last token."""
        d = self.deployment
        self.batches += 1
        requests = [self.request(new_tokens) for _ in range(clips)]
        sinks = [TimedSink() for _ in requests]
        start = time.perf_counter()
        for i, (request, sink) in enumerate(zip(requests, sinks)):
            sink.submitted = time.perf_counter()
            d.runtime.submit(f"s4-{self.batches}-{i}", request, d.spec.output_stream(request, []), sink)
        wait_all(sinks, timeout_s)
        for i, sink in enumerate(sinks):
            if sink.error or len(sink.token_times) != new_tokens:
                raise RuntimeError(f"clip {i} of {clips}: {len(sink.token_times)} of {new_tokens} tokens, "
                                   f"finish {sink.finish_reason!r}, error {sink.error!r}")
        return max(s.last_s for s in sinks) - start

    def close(self) -> None:
        self.deployment.close()
        del self.deployment


def run_ours(settings: Settings, model_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    runner = OursRunner(settings, model_dir)
    out["startup_s"] = time.perf_counter() - t0
    log.info("ours: deployment ready in %.1f s", out["startup_s"])
    try:
        t0 = time.perf_counter()
        for n in settings.batches:
            runner.run(n, settings.warmup_tokens)
        out["warmup_s"] = time.perf_counter() - t0
        for n in settings.batches:
            walls = [runner.run(n, settings.new_tokens) for _ in range(settings.runs)]
            wall = statistics.median(walls)
            out[n] = {"wall_s": walls, "rtf": n * settings.clip_s / wall,
                      "ms_per_token": wall / settings.new_tokens * 1e3}
            log.info("ours: %d clip(s): %.2f s, %.1fx real time", n, wall, out[n]["rtf"])
    finally:
        runner.close()
        del runner
        gc.collect()
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- baseline
def build_baseline(settings: Settings, model_dir: Path) -> torch.nn.Module:
    """transformers' WhisperForConditionalGeneration with the same config, random normal
    weights drawn on the device (built on the meta device, then ``to_empty``)."""
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

    device = torch.device(settings.device)
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(WhisperConfig.from_pretrained(model_dir))
    model = model.to(dtype=settings.dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02, generator=generator)
            elif "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.zero_()
    model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model.eval()


def run_baseline(settings: Settings, model_dir: Path) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate's notes on max_length and masks, once per call
    device = torch.device(settings.device)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    model = build_baseline(settings, model_dir)
    out["startup_s"] = time.perf_counter() - t0
    generator = torch.Generator(device=device).manual_seed(settings.seed + 1)
    frames = 2 * settings.model["max_source_positions"]

    def generate(model: torch.nn.Module, clips: int, tokens: int) -> float:  # an argument: the `del` below frees it
        features = torch.randn(clips, settings.model["num_mel_bins"], frames, device=device,
                               generator=generator).to(settings.dtype)
        synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            result = model.generate(features, language="en", task="transcribe", do_sample=False,
                                    max_new_tokens=tokens, min_new_tokens=tokens)
        synchronize(device)
        seconds = time.perf_counter() - start
        made = result.shape[-1]
        if made != tokens:
            raise RuntimeError(f"transformers generated {made} tokens, not {tokens}")
        return seconds

    try:
        out["warmup_s"] = {}
        for n in settings.batches:
            t0 = time.perf_counter()
            generate(model, n, settings.warmup_tokens)
            out["warmup_s"][n] = time.perf_counter() - t0
        for n in settings.batches:
            walls = [generate(model, n, settings.new_tokens) for _ in range(settings.baseline_runs)]
            wall = statistics.median(walls)
            out[n] = {"wall_s": walls, "rtf": n * settings.clip_s / wall,
                      "ms_per_token": wall / settings.new_tokens * 1e3}
            log.info("baseline: %d clip(s): %.2f s, %.1fx real time", n, wall, out[n]["rtf"])
    finally:
        del model
        gc.collect()
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------- report
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny model, CPU)" if settings.smoke else SCENARIO


def metrics_from(settings: Settings, roof: Roofline, ours: dict | None, baseline: dict | None) -> list[Metric]:
    rows = []
    for n in settings.batches:
        floor = n * settings.clip_s / roof.batch_seconds(n, settings.new_tokens)
        row = Metric(scenario_name(settings), f"rtf@{n}", "x real time", "higher", floor=floor)
        row.notes["floor_with_cross_kv_reads"] = n * settings.clip_s / roof.batch_seconds(
            n, settings.new_tokens, with_cross_kv=True)
        if ours and n in ours:
            row.ours = ours[n]["rtf"]
            row.notes.update({f"ours_{k}": v for k, v in ours[n].items()})
        if baseline and n in baseline:
            row.baseline = baseline[n]["rtf"]
            row.notes.update({f"baseline_{k}": v for k, v in baseline[n].items()})
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few tokens (checks the code paths)")
    p.add_argument("--batches", default=None, help="clips submitted at once, comma separated (default 1,32; smoke 1,4)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens decoded per clip (default 100; smoke 8)")
    p.add_argument("--clip-seconds", type=float, default=30.0, help="audio per clip (Whisper's window is 30 s)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens per clip of the warm-up batches")
    p.add_argument("--runs", type=int, default=3, help="timed batches of ours per batch size (median)")
    p.add_argument("--baseline-runs", type=int, default=3,
                   help="timed generate calls per batch size (median: one slow first call is dropped)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run transformers")
    p.add_argument("--skip-ours", action="store_true", help="do not run M*")
    p.add_argument("--attention-backend", choices=("torch", "triton"), default=None,
                   help="model_kwargs.attention_backend of the M* decoder (default: the engine's)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="model_kwargs.cuda_graphs=true: M* decode steps replay CUDA graphs (implies triton)")
    p.add_argument("--overlap", action="store_true",
                   help="model_kwargs.overlap_scheduling=true: launch each decode step before the last one's "
                        "tokens are read back")
    p.add_argument("--fused-kernels", action="store_true",
                   help="model_kwargs.fused_kernels=true: one q/k/v GEMM, Triton residual add + LayerNorm "
                        "(--smoke runs them under Triton's CPU interpreter)")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    if args.smoke and args.fused_kernels:  # the CPU runs the Triton kernels interpreted
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise SystemExit("--smoke --fused-kernels: set TRITON_INTERPRET=1 (triton is already imported)")
        os.environ["TRITON_INTERPRET"] = "1"
    settings = settings_from(args)
    device = torch.device(settings.device)
    started = time.perf_counter()
    log.info("S4 settings: %s", settings.describe())

    bandwidth = measure_memory_bandwidth(device)
    tflops = measure_matmul_tflops(device, settings.dtype)
    roof = Roofline.of(settings.model, settings.dtype, bandwidth, tflops, 2 * settings.model["max_source_positions"])
    log.info("measured %.0f GB/s, %.1f TFLOP/s; %.2f GB decoder weights per step, %.2f TFLOP per clip",
             bandwidth, tflops, roof.decoder_bytes_per_step / 1e9, roof.clip_flops / 1e12)

    ours = baseline = None
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="s4-whisper-") as tmp:
        model_dir = whisper_dir(tmp, **settings.model)
        if not args.skip_ours:
            ours = run_ours(settings, model_dir)
        if not args.skip_baseline:
            try:
                baseline = run_baseline(settings, model_dir)
            except Exception as err:  # keep ours' numbers when the baseline cannot run
                log.exception("baseline failed")
                errors["baseline"] = f"{type(err).__name__}: {err}"

    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"memory_bandwidth_gbs": bandwidth, "matmul_tflops": tflops,
                     "decoder_bytes_per_step": roof.decoder_bytes_per_step,
                     "decoder_flops_per_token": roof.decoder_flops_per_token,
                     "clip_flops": roof.clip_flops, "cross_kv_bytes_per_clip": roof.cross_kv_bytes_per_clip},
        "metrics": metrics_from(settings, roof, ours, baseline),
        "ours": _jsonable(ours),
        "baseline": _jsonable(baseline),
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S4 done in %.1f s", record["total_s"])
    return 1 if errors else 0


def _jsonable(result: dict[Any, Any] | None) -> dict[str, Any] | None:
    return None if result is None else {str(k): v for k, v in result.items()}


if __name__ == "__main__":
    sys.exit(main())
