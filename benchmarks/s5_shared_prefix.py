"""S5: shared-prefix prompts, the prefix cache on against off.

Llama-3.1-8B shapes, bf16 on one GPU, random ("dummy") weights (S1's model and engine
flags). 64 streams submitted at once; every prompt is one 1,024-token prefix (a long system
prompt) then 64 tokens of its own; 128 new tokens each, greedy, EOS ignored.

* **ours**: an in-process ``llama`` deployment with ``model_kwargs.prefix_caching: true``,
  driven as S1 drives it (``s1_llama_decode.OursRunner``: WalkRequests straight to the
  runtime, every token timestamped as the frontend gets it).
* **baseline**: the same deployment with ``prefix_caching: false``, the same prompts. So
  ``ours/baseline`` is what the cache buys: issue 17 asks for time to first token at 64
  streams at most 1/3 of the cache-off figure, and throughput at least 1.5x.
* Both deployments first run one warm-up batch with the same prefix, so the timed batches
  find it cached (a system prompt that every request repeats). ``--cold-prefix`` draws a new
  prefix for every batch instead: only the batch's own requests can share it.
* **floor** (``s1_llama_decode.Roofline`` at the measured bandwidth and matmul rate), with
  reuse of the prefix: the prefill of the 64 suffixes against the cached prefix (plus the
  prefix once with ``--cold-prefix``), then the decode steps with the prefix's K/V read once
  per step for all streams. The notes hold the floor without reuse (every prompt prefilled
  whole, every sequence's K/V read) and with the prefill reused but the prefix's K/V read
  per sequence. A time-to-first-token floor at quantile q is the prefill of the first
  ceil(q x N) prompts: the best order could finish those first.

``--smoke`` runs the same code paths with a tiny model on the CPU in seconds.
See benchmarks/README.md for the command lines.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import s1_llama_decode as s1
from benchmarks.common import (
    LLAMA_3_1_8B,
    LLAMA_TINY,
    Metric,
    add_run_args,
    hardware,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    setup_logging,
    tiny_llama_dir,
    write_record,
)

NAME = "s5_shared_prefix"
SCENARIO = "S5 llama-3.1-8B shared prefix"
MODES = {"off": False, "on": True}  # the two deployments: model_kwargs.prefix_caching
TTFT_TARGET = 1 / 3  # issue 17: TTFT with the cache at most 1/3 of without
THROUGHPUT_TARGET = 1.5  # and throughput at least 1.5x

log = logging.getLogger("s5")


@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON); ``engine`` holds S1's settings
    of the deployment (model, device, dtype, fast paths, one stream count, whole prompts)."""

    engine: s1.Settings
    prefix_len: int
    suffix_len: int
    runs: int
    cold_prefix: bool
    modes: tuple[str, ...]

    @property
    def streams(self) -> int:
        return self.engine.streams[0]

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len

    @property
    def kv_pages(self) -> int:
        """Every stream at full length, and room for two prefixes kept in the cache besides
        (the last batch's, and with ``--cold-prefix`` the one coming in)."""
        return self.engine.kv_pages + 2 * -(-self.prefix_len // s1.PAGE_SIZE)

    def describe(self) -> dict[str, Any]:
        return {**self.engine.describe(), "prefix_len": self.prefix_len, "suffix_len": self.suffix_len,
                "runs": self.runs, "cold_prefix": self.cold_prefix, "modes": list(self.modes),
                "kv_cache_pages": self.kv_pages}


def settings_from(args: argparse.Namespace) -> Settings:
    if args.smoke:
        device, dtype, model = "cpu", torch.float32, dict(LLAMA_TINY)
        streams, prefix_len, suffix_len = args.streams or 4, args.prefix_len or 64, args.suffix_len or 8
        new_tokens, runs = args.new_tokens or 8, args.runs or 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S5 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, model = "cuda", torch.bfloat16, dict(LLAMA_3_1_8B)
        streams, prefix_len, suffix_len = args.streams or 64, args.prefix_len or 1024, args.suffix_len or 64
        new_tokens, runs = args.new_tokens or 128, args.runs or 3
    if new_tokens < 2 or suffix_len < 1 or prefix_len < 1:
        raise SystemExit("--new-tokens must be at least 2, --prefix-len and --suffix-len at least 1")
    modes = tuple(m.strip() for m in args.cache.split(","))
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--cache takes {' and/or '.join(MODES)}, comma separated; got {args.cache!r}")
    engine = s1.Settings(
        smoke=args.smoke, device=device, dtype=dtype, model=model, prompt_len=prefix_len + suffix_len,
        new_tokens=new_tokens, streams=(streams,), warmup_tokens=min(args.warmup_tokens, new_tokens),
        latency_runs=runs, baseline_runs=0, attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs, overlap=args.overlap, seed=args.seed, fused_kernels=args.fused_kernels)
    return Settings(engine=engine, prefix_len=prefix_len, suffix_len=suffix_len, runs=runs,
                    cold_prefix=args.cold_prefix, modes=tuple(m for m in MODES if m in modes))


# ----------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class Batch:
    """The prompts of one batch: ``prefix + suffixes[i]`` for stream i."""

    prefix: torch.Tensor
    suffixes: list[torch.Tensor]

    def prompts(self) -> list[torch.Tensor]:
        return [torch.cat([self.prefix, suffix]) for suffix in self.suffixes]


def batches(settings: Settings) -> list[Batch]:
    """The warm-up batch, then the ``runs`` timed ones: the same for both deployments. One
    prefix for all (a cached system prompt), or with ``cold_prefix`` a new one per batch."""
    generator = torch.Generator().manual_seed(settings.engine.seed)
    vocab = settings.engine.model["vocab_size"]

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n,), generator=generator, dtype=torch.int64)

    shared = ids(settings.prefix_len)
    return [Batch(ids(settings.prefix_len) if settings.cold_prefix else shared,
                  [ids(settings.suffix_len) for _ in range(settings.streams)])
            for _ in range(1 + settings.runs)]


# ------------------------------------------------------------------------------- ours
def run_mode(settings: Settings, model_dir: Path, mode: str, plan: list[Batch]) -> dict[str, Any]:
    """One deployment (``prefix_caching`` per ``mode``): a warm-up batch, then the timed ones."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    runner = s1.OursRunner(settings.engine, model_dir, model_kwargs={"prefix_caching": MODES[mode]},
                           kv_pages=settings.kv_pages)
    out["startup_s"] = time.perf_counter() - t0
    log.info("cache %s: deployment ready in %.1f s", mode, out["startup_s"])
    n, new_tokens = settings.streams, settings.engine.new_tokens
    try:
        t0 = time.perf_counter()
        runner.run(n, settings.engine.warmup_tokens, prompts=plan[0].prompts())
        out["warmup_s"] = time.perf_counter() - t0
        timed = [runner.run(n, new_tokens, prompts=batch.prompts()) for batch in plan[1:]]
        out.update(s1.summarize(timed, new_tokens))
        log.info("cache %s: %d streams: first token median %.1f ms, p90 %.1f ms; %.1f tok/s", mode, n,
                 out["first_token_ms_median"], out["first_token_ms_p90"], out["throughput_tok_s"])
    finally:
        runner.close()
        del runner
        gc.collect()
        if settings.engine.device == "cuda":
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------- report
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny model, CPU)" if settings.engine.smoke else SCENARIO


def first_streams(streams: int, q: float) -> int:
    """How many prompts must be prefilled before the ``q`` quantile's first token (the
    nearest rank below, as ``s1.percentile`` and the lower median take it)."""
    return int(q * (streams - 1)) + 1


def floors(settings: Settings, roof: s1.Roofline) -> dict[str, Any]:
    """Seconds of the first tokens (median, p90) and of the whole batch: without reuse, with
    the prefill reused, and with the prefix's K/V also read once per decode step."""
    n, prefix, suffix = settings.streams, settings.prefix_len, settings.suffix_len
    steps = settings.engine.new_tokens - 1
    cold = [(prefix, 0)] if settings.cold_prefix else []

    def prefill(m: int, reuse: bool) -> float:
        return roof.prefill_seconds(cold + [(suffix, prefix)] * m if reuse else [(prefix + suffix, 0)] * m)

    out: dict[str, Any] = {}
    for q, name in ((0.5, "p50"), (0.9, "p90")):
        m = first_streams(n, q)
        out[f"ttft_{name}"] = {"without_reuse": prefill(m, False), "with_reuse": prefill(m, True)}
    decode = roof.decode_seconds(n, prefix + suffix, steps)
    decode_shared = roof.decode_seconds(n, prefix + suffix, steps, shared=prefix)
    out["batch"] = {"without_reuse": prefill(n, False) + decode, "prefill_reuse_only": prefill(n, True) + decode,
                    "with_reuse": prefill(n, True) + decode_shared}
    return out


def metrics_from(settings: Settings, roof: s1.Roofline, results: dict[str, dict[str, Any]]) -> list[Metric]:
    """Time to first token (median, p90) and throughput; ours is the cache on, baseline off."""
    scenario, n = scenario_name(settings), settings.streams
    tokens = n * settings.engine.new_tokens
    bound = floors(settings, roof)
    on, off = results.get("on") or {}, results.get("off") or {}
    rows: list[Metric] = []
    for name, field_name in (("p50", "first_token_ms_median"), ("p90", "first_token_ms_p90")):
        floor = bound[f"ttft_{name}"]
        row = Metric(scenario, f"ttft_{name}@{n}", "ms", "lower", ours=on.get(field_name),
                     baseline=off.get(field_name), floor=floor["with_reuse"] * 1e3)
        row.notes["floor_without_reuse"] = floor["without_reuse"] * 1e3
        row.notes["first_streams_prefilled"] = first_streams(n, 0.5 if name == "p50" else 0.9)
        row.notes["target_ours/baseline_at_most"] = TTFT_TARGET
        rows.append(row)
    floor = bound["batch"]
    row = Metric(scenario, f"throughput@{n}", "tok/s", "higher", ours=on.get("throughput_tok_s"),
                 baseline=off.get("throughput_tok_s"), floor=tokens / floor["with_reuse"])
    row.notes["floor_without_reuse"] = tokens / floor["without_reuse"]
    row.notes["floor_prefill_reuse_only"] = tokens / floor["prefill_reuse_only"]
    row.notes["target_ours/baseline_at_least"] = THROUGHPUT_TARGET
    rows.append(row)
    for row in rows:
        row.notes["ours_is"] = "prefix_caching: true"
        row.notes["baseline_is"] = "ours with prefix_caching: false (same prompts, same engine flags)"
        for side, result in (("ours", on), ("baseline", off)):
            row.notes.update({f"{side}_{k}": v for k, v in result.items() if k != "error"})
    return rows


def verdict(rows: list[Metric]) -> dict[str, Any]:
    """Issue 17's two conditions, from the rows (None where a side is missing)."""
    ttft, throughput = rows[0].vs_baseline, rows[-1].vs_baseline
    return {"ttft_p50_ratio": ttft, "throughput_ratio": throughput,
            "ttft_met": None if ttft is None else ttft <= TTFT_TARGET,
            "throughput_met": None if throughput is None else throughput >= THROUGHPUT_TARGET}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few tokens (checks the code paths)")
    p.add_argument("--streams", type=int, default=None, help="streams submitted at once (default 64; smoke 4)")
    p.add_argument("--prefix-len", type=int, default=None, help="tokens of the shared prefix (default 1024; smoke 64)")
    p.add_argument("--suffix-len", type=int, default=None,
                   help="tokens of each prompt's own part (default 64; smoke 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per stream (default 128; smoke 8)")
    p.add_argument("--runs", type=int, default=None, help="timed batches per deployment (default 3; smoke 1)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens per stream of the warm-up batch")
    p.add_argument("--cold-prefix", action="store_true",
                   help="a new prefix for every batch (default: one prefix, cached by the warm-up)")
    p.add_argument("--cache", default="off,on", help="which deployments to run: off, on or both")
    p.add_argument("--attention-backend", choices=("torch", "triton"), default=None,
                   help="model_kwargs.attention_backend of the M* engine (default: the engine's)")
    p.add_argument("--cuda-graphs", action="store_true", help="model_kwargs.cuda_graphs=true")
    p.add_argument("--fused-kernels", action="store_true", help="model_kwargs.fused_kernels=true (CUDA)")
    p.add_argument("--overlap", action="store_true", help="model_kwargs.overlap_scheduling=true")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(args)
    device = torch.device(settings.engine.device)
    started = time.perf_counter()
    log.info("S5 settings: %s", settings.describe())

    bandwidth = measure_memory_bandwidth(device)
    tflops = measure_matmul_tflops(device, settings.engine.dtype)
    roof = s1.Roofline.of(settings.engine.model, settings.engine.dtype, bandwidth, tflops)
    log.info("measured %.0f GB/s copy bandwidth, %.1f TFLOP/s matmul", bandwidth, tflops)

    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    plan = batches(settings)
    with tempfile.TemporaryDirectory(prefix="s5-llama-") as tmp:
        model_dir = tiny_llama_dir(tmp, **settings.engine.model)
        for mode in settings.modes:
            try:
                results[mode] = run_mode(settings, model_dir, mode, plan)
            except Exception as err:  # keep the other deployment's numbers
                log.exception("cache %s failed", mode)
                errors[f"cache {mode}"] = f"{type(err).__name__}: {err}"

    rows = metrics_from(settings, roof, results)
    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"memory_bandwidth_gbs": bandwidth, "matmul_tflops": tflops,
                     "weight_bytes_read_per_step": roof.weight_bytes_read,
                     "kv_bytes_per_position": roof.kv_bytes_per_position,
                     "floors_s": floors(settings, roof)},
        "metrics": rows,
        "ours": results.get("on"),
        "baseline": results.get("off"),
        "done_when": verdict(rows),
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S5 done in %.1f s; issue 17's conditions: %s", record["total_s"], record["done_when"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
