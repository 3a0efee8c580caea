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
* **floor**: what the workload must do at the measured bandwidth and matmul rate. A batch of
  N streams takes at least the prefill of its N prompts (their FLOPs, attention included, or
  one read of the weights, whichever is longer) plus its decode steps, each at least the
  longer of (weights + the KV cache of all N sequences at that length) / bandwidth and its
  FLOPs / matmul rate; throughput floor = N x new tokens / that time. Latency floor: the
  mean decode step of one stream.

``--long-context`` adds a row of 16 streams with 8,192-token prompts (its prefill dominates).

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
from collections.abc import Iterable
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
LONG = "long"  # the key of the long-context row's results (the other rows are keyed by stream count)

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
    long_context: tuple[int, int] | None = None  # (streams, prompt_len) of the long-context row
    prepare_threads: int | None = None  # the YAML key; None: asyncio's default executor

    @property
    def shapes(self) -> list[tuple[int | str, int, int]]:
        """Every batch shape the run times as ``(key, streams, prompt_len)``: the stream counts
        at ``prompt_len`` (keyed by the count), then the long-context row (keyed ``LONG``)."""
        return [(n, n, self.prompt_len) for n in self.streams] + ([(LONG, *self.long_context)] if self.long_context
                                                                  else [])

    @property
    def max_streams(self) -> int:
        return max(n for _, n, _ in self.shapes)

    @property
    def tokens_per_request(self) -> int:
        """The longest request (prompt and new tokens) of any shape."""
        return max(p for _, _, p in self.shapes) + self.new_tokens

    @property
    def pages_per_request(self) -> int:
        return -(-self.tokens_per_request // PAGE_SIZE)

    @property
    def kv_pages(self) -> int:
        """KV pages for the largest batch of any shape, all of its sequences at full length."""
        return max(n * -(-(p + self.new_tokens) // PAGE_SIZE) for _, n, p in self.shapes)

    @property
    def max_seq_len(self) -> int:
        # a page of slack: the engine stops a sequence one token short of max_seq_len
        return max(512, self.tokens_per_request + PAGE_SIZE)

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
            "long_context": (None if self.long_context is None
                             else {"streams": self.long_context[0], "prompt_len": self.long_context[1]}),
            "kv_cache_pages": self.kv_pages, "page_size": PAGE_SIZE, "max_seq_len": self.max_seq_len,
            "prepare_threads": self.prepare_threads,
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
    long_context = None
    if args.long_context:
        long_context = (args.long_context_streams or (2 if args.smoke else 16),
                        args.long_context_prompt_len or (256 if args.smoke else 8192))
    if device == "cuda" and tp_sizes and max(tp_sizes) > torch.cuda.device_count():
        raise SystemExit(f"--tp-sizes {args.tp_sizes}: TP={max(tp_sizes)} needs {max(tp_sizes)} GPUs, "
                         f"this machine has {torch.cuda.device_count()}")
    return Settings(
        smoke=args.smoke, device=device, dtype=dtype, model=model, prompt_len=prompt_len,
        new_tokens=new_tokens, streams=streams,
        warmup_tokens=min(args.warmup_tokens, new_tokens), latency_runs=args.latency_runs,
        baseline_runs=args.baseline_runs, attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs, overlap=args.overlap, seed=args.seed, fused_kernels=args.fused_kernels,
        tp_sizes=tp_sizes, long_context=long_context, prepare_threads=args.prepare_threads,
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
    """The decoder's costs from its shapes and the machine's measured limits: the least time
    of a prefill, of a decode step, and of a whole batch (prefill, then every decode step)."""

    bandwidth_gbs: float
    matmul_tflops: float
    weight_bytes_read: int  # per forward: every weight except the input embedding table
    flops_per_token: float  # matmuls only, at zero context, lm_head included
    lm_head_flops: float  # the lm_head's share of flops_per_token (a prefill needs one row per sequence)
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
            lm_head_flops=2.0 * vocab * h,
            kv_bytes_per_position=2 * layers * kv_heads * head_dim * size,
            attn_flops_per_position=4.0 * layers * heads * head_dim,
        )

    def _bound(self, nbytes: float, flops: float) -> float:
        return max(nbytes / (self.bandwidth_gbs * 1e9), flops / (self.matmul_tflops * 1e12))

    def step_seconds(self, streams: int, context: float = 0.0, shared: float = 0.0) -> float:
        """Least time of one decode step of ``streams`` sequences with ``context`` cached
        positions each: the weights and the KV cache read once from memory, or the FLOPs at
        the measured matmul rate, whichever takes longer. ``shared`` of the ``context``
        positions are one prefix common to every sequence, read once for all of them."""
        kv_positions = streams * (context - shared) + shared
        flops = streams * (self.flops_per_token + context * self.attn_flops_per_position)
        return self._bound(self.weight_bytes_read + kv_positions * self.kv_bytes_per_position, flops)

    def prefill_seconds(self, sequences: Iterable[tuple[int, int]]) -> float:
        """Least time of one prefill of ``sequences``, each ``(new tokens, cached positions)``:
        every new token's matmuls (the lm_head once per sequence: only the last position's
        logits are needed) and its causal attention over the cached and earlier new positions,
        at the matmul rate; or one read of the weights and the cached K/V plus the write of the
        new K/V, at the bandwidth; whichever takes longer."""
        flops = kv = 0.0
        for new, cached in sequences:
            flops += new * (self.flops_per_token - self.lm_head_flops) + self.lm_head_flops
            flops += (new * cached + new * (new + 1) / 2) * self.attn_flops_per_position
            kv += new + cached
        return self._bound(self.weight_bytes_read + kv * self.kv_bytes_per_position, flops)

    def decode_seconds(self, streams: int, prompt_len: int, steps: int, shared: float = 0.0) -> float:
        """Least time of ``steps`` decode steps after a ``prompt_len``-token prefill: step k
        (from 1) reads the KV cache of ``prompt_len + k`` positions per sequence."""
        return sum(self.step_seconds(streams, prompt_len + k, shared) for k in range(1, steps + 1))

    def batch_seconds(self, streams: int, prompt_len: int, new_tokens: int) -> float:
        """Least time of a whole batch: ``streams`` prompts of ``prompt_len`` tokens prefilled,
        then the ``new_tokens - 1`` decode steps after the prefill's first token."""
        return (self.prefill_seconds([(prompt_len, 0)] * streams)
                + self.decode_seconds(streams, prompt_len, new_tokens - 1))

    def throughput_floor(self, streams: int, prompt_len: int, new_tokens: int) -> float:
        """The greatest tokens/s of that batch: ``streams x new_tokens`` over its least time."""
        return streams * new_tokens / self.batch_seconds(streams, prompt_len, new_tokens)


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


def deployment_config(settings: Settings, model_dir: Path, tp_size: int | None = None,
                      model_kwargs: dict[str, Any] | None = None, kv_pages: int | None = None) -> dict[str, Any]:
    """The deployment YAML's keys, as a dict: ours in process, ours with ``tp_size`` and the
    server of ``--http`` all run this one. ``model_kwargs`` are added to those of the flags,
    and ``kv_pages`` replaces the pool size the settings call for."""
    kwargs: dict[str, Any] = {"cuda_graphs": settings.cuda_graphs, "overlap_scheduling": settings.overlap,
                              "fused_kernels": settings.fused_kernels}
    if settings.attention_backend:
        kwargs["attention_backend"] = settings.attention_backend
    kwargs.update(model_kwargs or {})
    config: dict[str, Any] = {"prepare_threads": settings.prepare_threads} if settings.prepare_threads else {}
    return config | {
        "model": "llama",
        "model_path": str(model_dir),
        "load_format": "dummy",
        "device": settings.device,
        "dtype": str(settings.dtype).removeprefix("torch."),
        "max_seq_len": settings.max_seq_len,
        "max_concurrent_requests": settings.max_streams,
        "resources": {"kv_cache": {"max_num_pages": kv_pages or settings.kv_pages, "page_size": PAGE_SIZE}},
        "model_kwargs": kwargs,
        "node_groups": [] if tp_size is None else [llm_group(tp_size)],
    }


class OursRunner:
    """An M* deployment of the llama model, driven through its runtime: in process, or with
    ``tp_size`` set, one worker process per rank and ``llm`` split over ranks 0..tp_size-1.

    ``model_kwargs`` are added to those of the flags, and ``kv_pages`` replaces the pool size
    the settings call for (S5 uses both: ``prefix_caching``, and room for the cached prefix)."""

    def __init__(self, settings: Settings, model_dir: Path, tp_size: int | None = None,
                 model_kwargs: dict[str, Any] | None = None, kv_pages: int | None = None):
        from mstar.config import parse_config
        from mstar.contract import SamplingParams
        from mstar.runtime.launch import start

        self.settings = settings
        config = parse_config(deployment_config(settings, model_dir, tp_size, model_kwargs, kv_pages), "s1 config")
        self.config = config
        greedy = SamplingParams(temperature=0.0)
        self.sampling = {f: getattr(greedy, f) for f in greedy.__struct_fields__}
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.batches = 0
        self.deployment = start(config, in_process=tp_size is None)

    def random_prompt(self, length: int) -> torch.Tensor:
        """``length`` random token ids (the runner's generator: the same run draws the same)."""
        return torch.randint(0, self.settings.model["vocab_size"], (length,), generator=self.generator,
                             dtype=torch.int64)

    def request(self, new_tokens: int, prompt_len: int | None = None, prompt: torch.Tensor | None = None):
        """A greedy ``chat`` walk of ``new_tokens`` tokens (EOS ignored) after ``prompt``, or
        after ``prompt_len`` (default: the settings') random ids."""
        from mstar.model.spec import WalkRequest

        ids = prompt if prompt is not None else self.random_prompt(prompt_len or self.settings.prompt_len)
        params = {"sampling": dict(self.sampling), "max_new_tokens": new_tokens,
                  "max_decode_steps": new_tokens - 1, "stop_token_ids": []}
        pages = -(-(len(ids) + new_tokens) // PAGE_SIZE)
        return WalkRequest("chat", {"prompt_ids": ids}, params, {"kv_pages": pages}, prompt_tokens=len(ids))

    def run(self, streams: int, new_tokens: int, timeout_s: float = 900.0, prompt_len: int | None = None,
            prompts: list[torch.Tensor] | None = None) -> BatchTiming:
        """Submit ``streams`` requests at once (of ``prompts``, or random prompts of
        ``prompt_len`` tokens) and wait until every one has finished."""
        d = self.deployment
        self.batches += 1
        if prompts is not None and len(prompts) != streams:
            raise ValueError(f"{len(prompts)} prompts for {streams} streams")
        requests = [self.request(new_tokens, prompt_len, None if prompts is None else prompts[i])
                    for i in range(streams)]
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
        for _, n, prompt_len in settings.shapes:
            runner.run(n, settings.warmup_tokens, prompt_len=prompt_len)
        out["warmup_s"] = time.perf_counter() - t0
        log.info("ours%s: warm-up (%s streams x prompt, %d tokens) took %.1f s", _tp_tag(tp_size),
                 [shape[1:] for shape in settings.shapes], settings.warmup_tokens, out["warmup_s"])
        for key, n, prompt_len in settings.shapes:
            # several batches per shape, the median kept: one batch swings with its prefill
            runs = [runner.run(n, settings.new_tokens, prompt_len=prompt_len) for _ in range(settings.latency_runs)]
            out[key] = summarize(runs, settings.new_tokens)
            out[key].update(streams=n, prompt_len=prompt_len)
            log.info("ours%s: %d stream(s), %d-token prompts: ITL median %.2f ms, first token %.0f ms, %.1f tok/s",
                     _tp_tag(tp_size), n, prompt_len, out[key]["inter_token_ms_median"],
                     out[key]["first_token_ms_median"], out[key]["throughput_tok_s"])
    finally:
        runner.close()
        del runner
        gc.collect()
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    return out


def summarize(runs: list, new_tokens: int) -> dict[str, Any]:
    """Inter-token and first-token times pooled over ``runs`` (``BatchTiming`` in process,
    ``http_load.StreamBatch`` over HTTP; median, p90), the median throughput and time per
    token of a batch."""
    itl = sorted(x for r in runs for x in r.inter_token_s())
    ttft = sorted(x for r in runs for x in r.first_token_s())
    return {
        "inter_token_ms_median": statistics.median(itl) * 1e3,
        "inter_token_ms_p90": percentile(itl, 0.9) * 1e3,
        "first_token_ms_median": statistics.median(ttft) * 1e3,
        "first_token_ms_p90": percentile(ttft, 0.9) * 1e3,
        "total_ms_per_token": statistics.median(r.wall_s / new_tokens for r in runs) * 1e3,
        "throughput_tok_s": statistics.median(r.throughput for r in runs),
        "wall_s": [r.wall_s for r in runs],
        "tokens": runs[0].tokens,
    }


def percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of ``ordered`` (sorted), the nearest rank below."""
    return ordered[int(q * (len(ordered) - 1))]


def _tp_tag(tp_size: int | None) -> str:
    return "" if tp_size is None else f" tp={tp_size}"


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
            out[n] = summarize(runs, settings.new_tokens)
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

    def generate(model: torch.nn.Module, batch: int, prompt_len: int) -> float:  # `del` below frees model
        ids = torch.randint(0, settings.model["vocab_size"], (batch, prompt_len), device=device,
                            generator=generator)
        synchronize(device)
        start = time.perf_counter()
        result = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=settings.new_tokens, min_new_tokens=settings.new_tokens,
                                do_sample=False, cache_implementation="static",
                                pad_token_id=eos, eos_token_id=eos)
        synchronize(device)
        seconds = time.perf_counter() - start
        made = result.shape[1] - prompt_len
        if made != settings.new_tokens:
            raise RuntimeError(f"transformers generated {made} tokens, not {settings.new_tokens}")
        return seconds

    def timed(model: torch.nn.Module, n: int, prompt_len: int) -> dict[str, Any]:
        seconds = statistics.median(generate(model, n, prompt_len) for _ in range(settings.baseline_runs))
        log.info("baseline: batch %d, %d-token prompts: %.2f ms/token, %.1f tok/s", n, prompt_len,
                 seconds / settings.new_tokens * 1e3, n * settings.new_tokens / seconds)
        return {"wall_s": seconds, "total_ms_per_token": seconds / settings.new_tokens * 1e3,
                "throughput_tok_s": n * settings.new_tokens / seconds, "streams": n, "prompt_len": prompt_len}

    try:
        out["warmup_s"] = {}
        for n in settings.streams:  # the first call at each batch size compiles (on CUDA)
            t0 = time.perf_counter()
            generate(model, n, settings.prompt_len)
            out["warmup_s"][n] = time.perf_counter() - t0
            log.info("baseline: warm-up at batch %d took %.1f s", n, out["warmup_s"][n])
        for n in settings.streams:
            out[n] = timed(model, n, settings.prompt_len)
        if settings.long_context:
            n, prompt_len = settings.long_context
            try:  # an error of its own: the other rows stand whatever the long prompts do
                t0 = time.perf_counter()
                generate(model, n, prompt_len)
                out["warmup_s"][LONG] = time.perf_counter() - t0
                log.info("baseline: warm-up at batch %d, %d-token prompts took %.1f s", n, prompt_len,
                         out["warmup_s"][LONG])
                out[LONG] = timed(model, n, prompt_len)
            except Exception as err:
                log.exception("baseline at the long-context shape failed")
                out[LONG] = {"error": f"{type(err).__name__}: {err}"}
    finally:
        del model
        _free_cuda(settings)
    return out


def _free_cuda(settings: Settings) -> None:
    gc.collect()
    if settings.device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- report
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny model, CPU)" if settings.smoke else SCENARIO


def metrics_from(settings: Settings, roof: Roofline, ours: dict[str, Any] | None,
                 baseline: dict[str, Any] | None, tp_size: int | None = None) -> list[Metric]:
    """One row per stream count, then the long-context row. With ``tp_size`` the metric names
    end in ``tp=N`` and the floor is one GPU's divided by N: weights, KV cache and FLOPs split
    evenly over N GPUs, the all-reduces taken as free (an ideal no TP run reaches).

    Floors count the whole workload (``Roofline.batch_seconds``): a throughput row's floor is
    its batch's prefill plus every decode step with the KV reads at each step's length; the
    latency row's is one stream's mean decode step. The notes keep the weights-only decode
    step (the floor column of the runs before 2026-12) and the prefill's share."""
    rows: list[Metric] = []
    scenario = scenario_name(settings)
    suffix, split = ("", 1) if tp_size is None else (f" tp={tp_size}", tp_size)
    steps = settings.new_tokens - 1
    for key, n, prompt_len in settings.shapes:
        prefill = roof.prefill_seconds([(prompt_len, 0)] * n) / split
        decode = roof.decode_seconds(n, prompt_len, steps) / split
        weights_only = roof.step_seconds(n) / split
        notes: dict[str, Any] = {
            "floor_first_token_ms": prefill * 1e3,
            "floor_decode_step_ms_mean": decode / steps * 1e3,
            "floor_decode_step_ms_weights_only": weights_only * 1e3,
            "prompt_len": prompt_len,
        }
        if key == 1:
            row = Metric(scenario, f"latency@1{suffix}", "ms/token", "lower", floor=decode / steps * 1e3)
            value = "inter_token_ms_median", "total_ms_per_token"
        else:
            name = f"throughput@{n}" if key == n else f"throughput@{n} prompt={prompt_len}"
            row = Metric(scenario, name + suffix, "tok/s", "higher", floor=n * settings.new_tokens / (prefill + decode))
            notes["floor_tok_s_weights_only"] = n / weights_only
            notes["floor_tok_s_decode_only"] = n / (decode / steps)
            value = "throughput_tok_s", "throughput_tok_s"
        row.notes.update(notes)
        for side, source, field_name in (("ours", ours, value[0]), ("baseline", baseline, value[1])):
            result = (source or {}).get(key)
            if result is None:
                continue
            if "error" in result:
                row.notes[f"{side}_error"] = result["error"]
                continue
            setattr(row, side, result[field_name])
            row.notes.update({f"{side}_{k}": v for k, v in result.items()})
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
                         floor=roof.throughput_floor(n, settings.prompt_len, settings.new_tokens) * tp)
            row.notes["baseline_is"] = f"ours at tp={base_tp} (worker processes), not transformers"
            row.notes["gpus"] = tp
            rows.append(row)
    return rows


def http_metrics(settings: Settings, roof: Roofline, http: dict[str, Any],
                 ours: dict[str, Any] | None) -> list[Metric]:
    """Per stream count, ours over HTTP beside ours in process: ``latency@1 http`` and
    ``throughput@N http`` (the floors as in process) and ``ttft@N http`` (ms; floor: the prefill), each
    with *baseline* the in-process figure, so that ours/baseline is HTTP over in process."""
    rows: list[Metric] = []
    scenario = scenario_name(settings)
    for n in settings.streams:
        if n not in http:
            continue
        inproc = (ours or {}).get(n)
        steps = settings.new_tokens - 1
        if n == 1:
            row = Metric(scenario, "latency@1 http", "ms/token", "lower",
                         floor=roof.decode_seconds(1, settings.prompt_len, steps) / steps * 1e3,
                         ours=http[n]["inter_token_ms_median"],
                         baseline=inproc["inter_token_ms_median"] if inproc else None)
        else:
            row = Metric(scenario, f"throughput@{n} http", "tok/s", "higher",
                         floor=roof.throughput_floor(n, settings.prompt_len, settings.new_tokens),
                         ours=http[n]["throughput_tok_s"], baseline=inproc["throughput_tok_s"] if inproc else None)
        ttft = Metric(scenario, f"ttft@{n} http", "ms", "lower", ours=http[n]["first_token_ms_median"],
                      floor=roof.prefill_seconds([(settings.prompt_len, 0)] * n) * 1e3,
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
    p.add_argument("--long-context", action="store_true",
                   help="add a row of long prompts (default 16 streams x 8192 tokens; smoke 2 x 256)")
    p.add_argument("--long-context-streams", type=int, default=None, help="streams of the long-context row")
    p.add_argument("--long-context-prompt-len", type=int, default=None, help="prompt tokens of the long-context row")
    p.add_argument("--http", action="store_true",
                   help="also run the same deployment behind a real `mstar serve` process, driven by N "
                        "concurrent streaming chat requests; rows `... http` beside the in-process ones")
    p.add_argument("--prepare-threads", type=int, default=None,
                   help="the deployment's prepare_threads (default unset: asyncio's default executor)")
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

    for side, result in (("baseline", baseline), *((f"ours tp={tp}", r) for tp, r in ours_by_tp.items())):
        if result and "error" in result.get(LONG, {}):
            errors[f"{side} long-context"] = result[LONG]["error"]
    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"memory_bandwidth_gbs": bandwidth, "matmul_tflops": tflops,
                     "weight_bytes_read_per_step": roof.weight_bytes_read,
                     "flops_per_token": roof.flops_per_token,
                     "kv_bytes_per_position": roof.kv_bytes_per_position,
                     "attn_flops_per_position": roof.attn_flops_per_position},
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
