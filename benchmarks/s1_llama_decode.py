"""S1: Llama-3.1-8B decode: latency of one stream, throughput of many, against transformers.

Llama-3.1-8B shapes (32 layers, hidden 4096, 32 heads / 8 KV heads, FFN 14336, vocab 128256,
llama3 RoPE scaling), bf16 on one GPU, random ("dummy") weights, 128-token random prompts,
128 new tokens with EOS ignored, greedy sampling.

* **ours**: an in-process M* deployment of the ``llama`` model; WalkRequests are submitted
  straight to its runtime (no HTTP) with a sink that timestamps every token as it reaches
  the frontend. Latency is the median inter-token time of one stream (first token
  excluded); throughput is generated tokens / wall time with N streams submitted at once.
* **baseline**: transformers ``LlamaForCausalLM`` (same config, bf16, random weights)
  through ``generate`` with a static cache, which transformers compiles for decoding;
  latency is total time / tokens at batch 1, throughput is tokens / time at batch N.
* **floor**: the hardware bound of one decode step, the larger of (bytes of weights read
  per step / measured memory bandwidth) and (FLOPs per step / measured matmul rate).

``--tp-sizes 1,2`` runs ours once per tensor-parallel size instead, each a deployment with
one worker process per rank (``llm`` over ranks ``0..N-1`` with ``tp_size: N``; TP=1 in a
worker process too, so that the sizes compare like for like), and adds a row per stream
count whose ours/baseline is the throughput at TP=N over TP=1.

``--smoke`` runs the same code paths with a tiny model on the CPU in well under a minute.
See benchmarks/README.md for the command lines.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import string
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    LLAMA_3_1_8B,
    LLAMA_TINY,
    Metric,
    add_run_args,
    hardware,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    setup_logging,
    synchronize,
    tiny_llama_dir,
    write_record,
)

NAME = "s1_llama_decode"
SCENARIO = "S1 llama-3.1-8B decode"
PAGE_SIZE = 16

log = logging.getLogger("s1")


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    model: dict[str, Any]
    prompt_len: int
    new_tokens: int
    streams: tuple[int, ...]
    warmup_tokens: int
    latency_runs: int
    baseline_runs: int
    attention_backend: str | None
    cuda_graphs: bool
    overlap: bool = False
    seed: int = 0
    fused_kernels: bool = False
    tp_sizes: tuple[int, ...] = ()  # empty: one in-process deployment; else one per TP size

    @property
    def max_streams(self) -> int:
        return max(self.streams)

    @property
    def tokens_per_request(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def pages_per_request(self) -> int:
        return -(-self.tokens_per_request // PAGE_SIZE)

    def describe(self) -> dict[str, Any]:
        return {
            "smoke": self.smoke, "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
            "model": self.model, "prompt_len": self.prompt_len, "new_tokens": self.new_tokens,
            "streams": list(self.streams), "warmup_tokens": self.warmup_tokens,
            "latency_runs": self.latency_runs, "baseline_runs": self.baseline_runs,
            "attention_backend": self.attention_backend, "cuda_graphs": self.cuda_graphs,
            "overlap_scheduling": self.overlap, "fused_kernels": self.fused_kernels,
            "seed": self.seed, "sampling": "greedy", "ignore_eos": True,
            "tp_sizes": list(self.tp_sizes) or None,
        }


def settings_from(args: argparse.Namespace) -> Settings:
    streams = tuple(sorted({int(s) for s in args.streams.split(",")})) if args.streams else None
    if args.smoke:
        device, dtype, model = "cpu", torch.float32, dict(LLAMA_TINY)
        prompt_len, new_tokens = args.prompt_len or 16, args.new_tokens or 16
        streams = streams or (1, 4)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S1 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, model = "cuda", torch.bfloat16, dict(LLAMA_3_1_8B)
        prompt_len, new_tokens = args.prompt_len or 128, args.new_tokens or 128
        streams = streams or (1, 16, 64)
    if new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (latency is measured between tokens)")
    tp_sizes = parse_tp_sizes(args.tp_sizes)
    if device == "cuda" and tp_sizes and max(tp_sizes) > torch.cuda.device_count():
        raise SystemExit(f"--tp-sizes {args.tp_sizes}: TP={max(tp_sizes)} needs {max(tp_sizes)} GPUs, "
                         f"this machine has {torch.cuda.device_count()}")
    return Settings(
        smoke=args.smoke, device=device, dtype=dtype, model=model, prompt_len=prompt_len,
        new_tokens=new_tokens, streams=streams,
        warmup_tokens=min(args.warmup_tokens, new_tokens), latency_runs=args.latency_runs,
        baseline_runs=args.baseline_runs, attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs, overlap=args.overlap, seed=args.seed, fused_kernels=args.fused_kernels,
        tp_sizes=tp_sizes,
    )


def parse_tp_sizes(text: str | None) -> tuple[int, ...]:
    """``"1,2"`` -> ``(1, 2)``; None or empty -> ``()`` (the single in-process run)."""
    if not text:
        return ()
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise SystemExit(f"--tp-sizes must be comma-separated whole numbers, got {text!r}") from None
    if sizes[0] < 1:
        raise SystemExit(f"--tp-sizes must be at least 1, got {text!r}")
    return sizes


# --------------------------------------------------------------------------- the bound
@dataclass(frozen=True)
class Roofline:
    """Per-step cost model of the decoder and the machine's measured limits."""

    bandwidth_gbs: float
    matmul_tflops: float
    weight_bytes_read: int  # per decode step: every weight except the input embedding table
    flops_per_token: float  # matmuls only, at zero context
    kv_bytes_per_position: int  # K and V of one position over all layers
    attn_flops_per_position: float  # QK^T and PV of one query against one cached position

    @classmethod
    def of(cls, model: dict[str, Any], dtype: torch.dtype, bandwidth_gbs: float,
           matmul_tflops: float) -> Roofline:
        h, ffn, layers = model["hidden_size"], model["intermediate_size"], model["num_hidden_layers"]
        heads, kv_heads, vocab = model["num_attention_heads"], model["num_key_value_heads"], model["vocab_size"]
        head_dim = model.get("head_dim") or h // heads
        per_layer = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 3 * h * ffn  # q,o + k,v + mlp
        matmul_params = layers * per_layer + vocab * h  # + lm_head (untied)
        norms = (2 * layers + 1) * h
        size = torch.finfo(dtype).bits // 8
        return cls(
            bandwidth_gbs=bandwidth_gbs,
            matmul_tflops=matmul_tflops,
            weight_bytes_read=(matmul_params + norms) * size,
            flops_per_token=2.0 * matmul_params,
            kv_bytes_per_position=2 * layers * kv_heads * head_dim * size,
            attn_flops_per_position=4.0 * layers * heads * head_dim,
        )

    def step_seconds(self, streams: int, context: float = 0.0) -> float:
        """Least time of one decode step of ``streams`` sequences with ``context`` cached
        positions each: weights (and, when ``context`` > 0, the KV cache) read once from
        memory, or the FLOPs at the measured matmul rate, whichever takes longer."""
        memory = (self.weight_bytes_read + streams * context * self.kv_bytes_per_position) / (self.bandwidth_gbs * 1e9)
        flops = streams * (self.flops_per_token + context * self.attn_flops_per_position)
        compute = flops / (self.matmul_tflops * 1e12)
        return max(memory, compute)


# ------------------------------------------------------------------------------- ours
@dataclass
class TimedStream:
    """A runtime sink that timestamps every token of one request as the frontend gets it."""

    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event) -> None:
        now = time.perf_counter()
        if event is None:
            self.done.set()
            return
        if event.token_ids:
            self.token_times.extend([now] * len(event.token_ids))
        if event.error:
            self.error = event.error
        if event.finish_reason:
            self.finish_reason = event.finish_reason


@dataclass
class BatchTiming:
    """N streams submitted together: when, and every token of each."""

    start: float
    streams: list[TimedStream]

    @property
    def tokens(self) -> int:
        return sum(len(s.token_times) for s in self.streams)

    @property
    def wall_s(self) -> float:
        return max(s.token_times[-1] for s in self.streams) - self.start

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s

    def inter_token_s(self) -> list[float]:
        return [b - a for s in self.streams for a, b in zip(s.token_times, s.token_times[1:])]

    def first_token_s(self) -> list[float]:
        return [s.token_times[0] - s.submitted for s in self.streams]


def deployment_config(settings: Settings, model_dir: Path, tp_size: int | None = None) -> dict[str, Any]:
    """The deployment YAML's keys, as a dict: ours in process, ours with ``tp_size`` and the
    server of ``--http`` all run this one."""
    model_kwargs: dict[str, Any] = {"cuda_graphs": settings.cuda_graphs,
                                    "overlap_scheduling": settings.overlap,
                                    "fused_kernels": settings.fused_kernels}
    if settings.attention_backend:
        model_kwargs["attention_backend"] = settings.attention_backend
    return {
        "model": "llama",
        "model_path": str(model_dir),
        "load_format": "dummy",
        "device": settings.device,
        "dtype": str(settings.dtype).removeprefix("torch."),
        "max_seq_len": max(512, settings.tokens_per_request),
        "max_concurrent_requests": settings.max_streams,
        "resources": {"kv_cache": {"max_num_pages": settings.max_streams * settings.pages_per_request,
                                   "page_size": PAGE_SIZE}},
        "model_kwargs": model_kwargs,
        "node_groups": [] if tp_size is None else [llm_group(tp_size)],
    }


class OursRunner:
    """An M* deployment of the llama model, driven through its runtime: in process, or with
    ``tp_size`` set, one worker process per rank and ``llm`` split over ranks 0..tp_size-1."""

    def __init__(self, settings: Settings, model_dir: Path, tp_size: int | None = None):
        from mstar.config import parse_config
        from mstar.contract import SamplingParams
        from mstar.runtime.launch import start

        self.settings = settings
        config = parse_config(deployment_config(settings, model_dir, tp_size), "s1 config")
        self.config = config
        greedy = SamplingParams(temperature=0.0)
        self.sampling = {f: getattr(greedy, f) for f in greedy.__struct_fields__}
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.batches = 0
        self.deployment = start(config, in_process=tp_size is None)

    def request(self, new_tokens: int):
        from mstar.model.spec import WalkRequest

        s = self.settings
        ids = torch.randint(0, s.model["vocab_size"], (s.prompt_len,), generator=self.generator, dtype=torch.int64)
        params = {"sampling": dict(self.sampling), "max_new_tokens": new_tokens,
                  "max_decode_steps": new_tokens - 1, "stop_token_ids": []}
        pages = -(-(s.prompt_len + new_tokens) // PAGE_SIZE)
        return WalkRequest("chat", {"prompt_ids": ids}, params, {"kv_pages": pages}, prompt_tokens=s.prompt_len)

    def run(self, streams: int, new_tokens: int, timeout_s: float = 900.0) -> BatchTiming:
        """Submit ``streams`` requests at once and wait until every one has finished."""
        d = self.deployment
        self.batches += 1
        requests = [self.request(new_tokens) for _ in range(streams)]
        sinks = [TimedStream() for _ in range(streams)]
        start = time.perf_counter()
        for i, (request, sink) in enumerate(zip(requests, sinks)):
            sink.submitted = time.perf_counter()
            d.runtime.submit(f"s1-{self.batches}-{i}", request, d.spec.output_stream(request, []), sink)
        deadline = time.monotonic() + timeout_s
        for sink in sinks:
            if not sink.done.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{streams} streams did not finish in {timeout_s:.0f} s")
        for i, sink in enumerate(sinks):
            if sink.error or len(sink.token_times) != new_tokens:
                raise RuntimeError(f"stream {i} of {streams}: {len(sink.token_times)} of {new_tokens} tokens, "
                                   f"finish {sink.finish_reason!r}, error {sink.error!r}")
        return BatchTiming(start, sinks)

    def close(self) -> None:
        self.deployment.close()
        del self.deployment


def llm_group(tp_size: int) -> dict[str, Any]:
    """The ``node_groups`` entry of the decoder split over ranks ``0..tp_size-1``."""
    if tp_size == 1:
        return {"node_names": ["llm"], "ranks": [0]}
    return {"node_names": ["llm"], "ranks": list(range(tp_size)), "tp_size": tp_size}


def run_ours(settings: Settings, model_dir: Path, tp_size: int | None = None) -> dict[str, Any]:
    """Latency at 1 stream and throughput at every other stream count, after a warm-up."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    runner = OursRunner(settings, model_dir, tp_size)
    out["startup_s"] = time.perf_counter() - t0
    log.info("ours%s: deployment ready in %.1f s", _tp_tag(tp_size), out["startup_s"])
    try:
        t0 = time.perf_counter()
        for n in settings.streams:
            runner.run(n, settings.warmup_tokens)
        out["warmup_s"] = time.perf_counter() - t0
        log.info("ours%s: warm-up (%s streams x %d tokens) took %.1f s", _tp_tag(tp_size), list(settings.streams),
                 settings.warmup_tokens, out["warmup_s"])
        for n in settings.streams:
            # several batches per stream count, the median kept: one batch swings with its prefill
            runs = [runner.run(n, settings.new_tokens) for _ in range(settings.latency_runs)]
            out[n] = summarise(runs, settings.new_tokens)
            log.info("ours%s: %d stream(s): ITL median %.2f ms, %.1f tok/s", _tp_tag(tp_size), n,
                     out[n]["inter_token_ms_median"], out[n]["throughput_tok_s"])
    finally:
        runner.close()
        del runner
        gc.collect()
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    return out


def _tp_tag(tp_size: int | None) -> str:
    return "" if tp_size is None else f" tp={tp_size}"


def summarise(runs: list, new_tokens: int) -> dict[str, Any]:
    """The figures of several batches at one stream count (``BatchTiming`` in process,
    ``http_load.StreamBatch`` over HTTP): latency pooled, throughput the median batch's."""
    itl = sorted(x for r in runs for x in r.inter_token_s())
    ttft = sorted(x for r in runs for x in r.first_token_s())
    return {
        "inter_token_ms_median": statistics.median(itl) * 1e3,
        "inter_token_ms_p90": itl[int(0.9 * (len(itl) - 1))] * 1e3,
        "first_token_ms_median": statistics.median(ttft) * 1e3,
        "first_token_ms_p90": ttft[int(0.9 * (len(ttft) - 1))] * 1e3,
        "total_ms_per_token": statistics.median(r.wall_s / new_tokens for r in runs) * 1e3,
        "throughput_tok_s": statistics.median(r.throughput for r in runs),
        "wall_s": [r.wall_s for r in runs],
        "tokens": runs[0].tokens,
    }


# ------------------------------------------------------------------------ ours over HTTP
def run_http(settings: Settings, model_dir: Path) -> dict[str, Any]:
    """The same deployment behind a real ``mstar serve`` process (worker processes, as the
    server runs them), driven by N concurrent streaming ``/v1/chat/completions`` requests:
    greedy, ``ignore_eos``, prompts of ``prompt_len`` random letters (one token each, the
    chat template adding none). Timed as the client receives the SSE events (http_load)."""
    from benchmarks.http_load import chat_body, run_chat_streams, serve_config, use_plain_chat_template

    use_plain_chat_template(model_dir)
    rng = random.Random(settings.seed + 2)
    out: dict[str, Any] = {}

    def batch(server, n: int, tokens: int):
        prompts = ["".join(rng.choices(string.ascii_lowercase, k=settings.prompt_len)) for _ in range(n)]
        result = run_chat_streams(server.url, [chat_body(p, tokens) for p in prompts])
        bad = result.errors() + [f"stream {i}: {s.completion_tokens} of {tokens} tokens"
                                 for i, s in enumerate(result.streams) if s.completion_tokens != tokens]
        if bad:
            raise RuntimeError(f"{n} streams over HTTP: {'; '.join(bad[:4])}")
        return result

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="s1-http-") as workdir, \
            serve_config(deployment_config(settings, model_dir, tp_size=None), workdir) as server:
        out["startup_s"] = time.perf_counter() - t0
        log.info("http: server ready in %.1f s", out["startup_s"])
        t0 = time.perf_counter()
        for n in settings.streams:
            batch(server, n, settings.warmup_tokens)
        out["warmup_s"] = time.perf_counter() - t0
        for n in settings.streams:
            runs = [batch(server, n, settings.new_tokens) for _ in range(settings.latency_runs)]
            out[n] = summarise(runs, settings.new_tokens)
            log.info("http: %d stream(s): ITL median %.2f ms, %.1f tok/s, TTFT median %.1f ms", n,
                     out[n]["inter_token_ms_median"], out[n]["throughput_tok_s"], out[n]["first_token_ms_median"])
    return out


# --------------------------------------------------------------------------- baseline
def build_baseline(settings: Settings, model_dir: Path) -> torch.nn.Module:
    """transformers' LlamaForCausalLM with the same config, random weights, in ``dtype`` on
    the device: built on the meta device, then materialised with ``to_empty`` (no CPU init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device(settings.device)
    config = LlamaConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
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
    # to_empty left the RoPE frequency buffers uninitialised: rebuild them (in float32).
    rotary = model.model.rotary_emb
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(config).to(device)
    model.eval()
    return model


def run_baseline(settings: Settings, model_dir: Path) -> dict[str, Any]:
    """transformers generate with a static cache: warm (compile) each batch size, then time."""
    device = torch.device(settings.device)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    model = build_baseline(settings, model_dir)
    out["startup_s"] = time.perf_counter() - t0
    generator = torch.Generator(device=device).manual_seed(settings.seed + 1)
    eos = model.config.eos_token_id

    def generate(model: torch.nn.Module, batch: int) -> float:  # an argument: the `del` below frees it
        ids = torch.randint(0, settings.model["vocab_size"], (batch, settings.prompt_len), device=device,
                            generator=generator)
        synchronize(device)
        start = time.perf_counter()
        result = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=settings.new_tokens, min_new_tokens=settings.new_tokens,
                                do_sample=False, cache_implementation="static",
                                pad_token_id=eos, eos_token_id=eos)
        synchronize(device)
        seconds = time.perf_counter() - start
        made = result.shape[1] - settings.prompt_len
        if made != settings.new_tokens:
            raise RuntimeError(f"transformers generated {made} tokens, not {settings.new_tokens}")
        return seconds

    try:
        out["warmup_s"] = {}
        for n in settings.streams:  # the first call at each batch size compiles (on CUDA)
            t0 = time.perf_counter()
            generate(model, n)
            out["warmup_s"][n] = time.perf_counter() - t0
            log.info("baseline: warm-up at batch %d took %.1f s", n, out["warmup_s"][n])
        for n in settings.streams:
            seconds = statistics.median(generate(model, n) for _ in range(settings.baseline_runs))
            out[n] = {"wall_s": seconds, "total_ms_per_token": seconds / settings.new_tokens * 1e3,
                      "throughput_tok_s": n * settings.new_tokens / seconds}
            log.info("baseline: batch %d: %.2f ms/token, %.1f tok/s", n, out[n]["total_ms_per_token"],
                     out[n]["throughput_tok_s"])
    finally:
        del model
        gc.collect()
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------- report
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny model, CPU)" if settings.smoke else SCENARIO


def metrics_from(settings: Settings, roof: Roofline, ours: dict[str, Any] | None,
                 baseline: dict[str, Any] | None, tp_size: int | None = None) -> list[Metric]:
    """One row per stream count. With ``tp_size`` the metric names end in ``tp=N`` and the
    floor is one GPU's divided by N: weights, KV cache and FLOPs split evenly over N GPUs,
    the all-reduces taken as free (an ideal no TP run reaches)."""
    rows: list[Metric] = []
    scenario = scenario_name(settings)
    mean_context = settings.prompt_len + (settings.new_tokens - 1) / 2
    suffix, split = ("", 1) if tp_size is None else (f" tp={tp_size}", tp_size)
    for n in settings.streams:
        floor_step = roof.step_seconds(n) / split
        with_kv = roof.step_seconds(n, mean_context) / split
        if n == 1:
            row = Metric(scenario, f"latency@1{suffix}", "ms/token", "lower", floor=floor_step * 1e3)
            row.notes["floor_with_kv_cache"] = with_kv * 1e3
            if ours and n in ours:
                row.ours = ours[n]["inter_token_ms_median"]
                row.notes.update({f"ours_{k}": v for k, v in ours[n].items()})
            if baseline and n in baseline:
                row.baseline = baseline[n]["total_ms_per_token"]
                row.notes.update({f"baseline_{k}": v for k, v in baseline[n].items()})
        else:
            row = Metric(scenario, f"throughput@{n}{suffix}", "tok/s", "higher", floor=n / floor_step)
            row.notes["floor_with_kv_cache"] = n / with_kv
            if ours and n in ours:
                row.ours = ours[n]["throughput_tok_s"]
                row.notes.update({f"ours_{k}": v for k, v in ours[n].items()})
            if baseline and n in baseline:
                row.baseline = baseline[n]["throughput_tok_s"]
                row.notes.update({f"baseline_{k}": v for k, v in baseline[n].items()})
        rows.append(row)
    return rows


def tp_metrics(settings: Settings, roof: Roofline, ours_by_tp: dict[int, dict[str, Any]],
               baseline: dict[str, Any] | None) -> list[Metric]:
    """The rows of every TP size, then per larger size and stream count (throughput at 2+
    streams) a row ``tp=N vs tp=1 throughput@S`` whose *ours* is TP=N's throughput and
    *baseline* TP=1's (ours too), so its ours/baseline is the speed-up of splitting."""
    rows = [row for tp, ours in ours_by_tp.items() for row in metrics_from(settings, roof, ours, baseline, tp)]
    if not ours_by_tp:
        return rows
    base_tp = 1 if 1 in ours_by_tp else min(ours_by_tp)
    base = ours_by_tp[base_tp]
    for tp, ours in ours_by_tp.items():
        if tp == base_tp:
            continue
        for n in settings.streams:
            if n == 1 or n not in ours or n not in base:
                continue
            row = Metric(scenario_name(settings), f"tp={tp} vs tp={base_tp} throughput@{n}", "tok/s", "higher",
                         ours=ours[n]["throughput_tok_s"], baseline=base[n]["throughput_tok_s"],
                         floor=n / (roof.step_seconds(n) / tp))
            row.notes["baseline_is"] = f"ours at tp={base_tp} (worker processes), not transformers"
            row.notes["gpus"] = tp
            rows.append(row)
    return rows


def http_metrics(settings: Settings, roof: Roofline, http: dict[str, Any],
                 ours: dict[str, Any] | None) -> list[Metric]:
    """Per stream count, ours over HTTP beside ours in process: ``latency@1 http`` and
    ``throughput@N http`` (the floor as in process) and ``ttft@N http`` (ms, no floor), each
    with *baseline* the in-process figure, so that ours/baseline is HTTP over in process."""
    rows: list[Metric] = []
    scenario = scenario_name(settings)
    for n in settings.streams:
        if n not in http:
            continue
        inproc = (ours or {}).get(n)
        if n == 1:
            row = Metric(scenario, "latency@1 http", "ms/token", "lower", floor=roof.step_seconds(1) * 1e3,
                         ours=http[n]["inter_token_ms_median"],
                         baseline=inproc["inter_token_ms_median"] if inproc else None)
        else:
            row = Metric(scenario, f"throughput@{n} http", "tok/s", "higher", floor=n / roof.step_seconds(n),
                         ours=http[n]["throughput_tok_s"], baseline=inproc["throughput_tok_s"] if inproc else None)
        ttft = Metric(scenario, f"ttft@{n} http", "ms", "lower", ours=http[n]["first_token_ms_median"],
                      baseline=inproc["first_token_ms_median"] if inproc else None)
        for r in (row, ttft):
            r.notes["baseline_is"] = "ours in process (runtime.submit, no HTTP), not transformers"
            r.notes.update({f"http_{k}": v for k, v in http[n].items()})
        rows += [row, ttft]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few tokens (checks the code paths)")
    p.add_argument("--streams", default=None, help="stream counts, comma separated (default 1,16,64; smoke 1,4)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; smoke 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per stream (default 128; smoke 16)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens per stream of ours' warm-up batches")
    p.add_argument("--latency-runs", type=int, default=3,
                   help="batches per stream count for ours (latency pooled, throughput median)")
    p.add_argument("--baseline-runs", type=int, default=3, help="timed generate calls per batch size (median)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run transformers")
    p.add_argument("--skip-ours", action="store_true", help="do not run M*")
    p.add_argument("--attention-backend", choices=("torch", "triton"), default=None,
                   help="model_kwargs.attention_backend of the M* engine (default: the engine's)")
    p.add_argument("--cuda-graphs", action="store_true", help="model_kwargs.cuda_graphs=true for the M* engine")
    p.add_argument("--fused-kernels", action="store_true",
                   help="model_kwargs.fused_kernels=true: fused Triton RMSNorm/SiLU/RoPE kernels (CUDA)")
    p.add_argument("--overlap", action="store_true",
                   help="model_kwargs.overlap_scheduling=true: launch decode k+1 before step k's host bookkeeping")
    p.add_argument("--tp-sizes", default=None,
                   help="tensor-parallel sizes, comma separated (e.g. 1,2): ours once per size with worker "
                        "processes, llm over ranks 0..N-1 (default: one in-process run)")
    p.add_argument("--http", action="store_true",
                   help="also run the same deployment behind a real `mstar serve` process, driven by N "
                        "concurrent streaming chat requests; rows `... http` beside the in-process ones")
    add_run_args(p)
    args = p.parse_args(argv)
    if args.http and args.tp_sizes:
        p.error("--http runs the single-GPU deployment: leave out --tp-sizes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(args)
    device = torch.device(settings.device)
    started = time.perf_counter()
    log.info("S1 settings: %s", settings.describe())

    bandwidth = measure_memory_bandwidth(device)
    tflops = measure_matmul_tflops(device, settings.dtype)
    roof = Roofline.of(settings.model, settings.dtype, bandwidth, tflops)
    log.info("measured %.0f GB/s copy bandwidth, %.1f TFLOP/s %s matmul; %.2f GB of weights read per step",
             bandwidth, tflops, settings.dtype, roof.weight_bytes_read / 1e9)

    ours = baseline = http = None
    ours_by_tp: dict[int, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="s1-llama-") as tmp:
        model_dir = tiny_llama_dir(tmp, **settings.model)
        if not args.skip_ours and settings.tp_sizes:
            for tp in settings.tp_sizes:
                try:
                    ours_by_tp[tp] = run_ours(settings, model_dir, tp)
                except Exception as err:  # keep the other sizes' numbers
                    log.exception("ours at tp=%d failed", tp)
                    errors[f"ours tp={tp}"] = f"{type(err).__name__}: {err}"
        elif not args.skip_ours:
            ours = run_ours(settings, model_dir)
        if args.http:
            try:
                http = run_http(settings, model_dir)
            except Exception as err:  # keep the in-process numbers
                log.exception("ours over HTTP failed")
                errors["http"] = f"{type(err).__name__}: {err}"
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
                     "weight_bytes_read_per_step": roof.weight_bytes_read,
                     "flops_per_token": roof.flops_per_token,
                     "kv_bytes_per_position": roof.kv_bytes_per_position},
        "metrics": (tp_metrics(settings, roof, ours_by_tp, baseline) if settings.tp_sizes
                    else metrics_from(settings, roof, ours, baseline)
                    + (http_metrics(settings, roof, http, ours) if http else [])),
        "ours": ({f"tp={tp}": _jsonable(result) for tp, result in ours_by_tp.items()} if settings.tp_sizes
                 else _jsonable(ours)),
        "baseline": _jsonable(baseline),
        "http": _jsonable(http),
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S1 done in %.1f s", record["total_s"])
    return 1 if errors else 0


def _jsonable(result: dict[Any, Any] | None) -> dict[str, Any] | None:
    """Stream counts as string keys (JSON object keys)."""
    if result is None:
        return None
    return {str(k): v for k, v in result.items()}


if __name__ == "__main__":
    sys.exit(main())
