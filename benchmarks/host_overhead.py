"""Host overhead of autoregressive decoding: what the runtime costs per decode step besides
the model.

An in-process deployment of the ``llama`` model (``LLAMA_TINY`` of benchmarks/common.py
with one layer, random weights) decodes N streams at once, greedy, EOS ignored, through
the runtime as S1 drives it (WalkRequests submitted to the runtime, a sink per stream).
The model's ``forward`` and ``compute_logits`` are timed from outside; the rest is host
work: the conductor's tick, plan and result handling, the worker's gathering and
delivery, the engine's metadata and sampling, the emit thread's detokenising.

    host ms per step = (wall of the decode phase - model time in it) / decode steps

The decode phase runs from the first engine step after every stream has its first token
to the last step, so prefill does not dilute the figure. Beside it, ``host CPU``: the
conductor thread's CPU time outside the model plus the emit thread's. On a loaded machine
wall time swings and CPU time much less, so compare CPU figures there. Each stream count
is repeated and the median reported. ``--profile`` prints a cProfile top list of the
conductor and emit threads' work at the largest stream count.

    python benchmarks/host_overhead.py                      # 1, 16, 64 streams
    python benchmarks/host_overhead.py --streams 64 --profile
    python benchmarks/host_overhead.py --overlap            # model_kwargs.overlap_scheduling
    python benchmarks/host_overhead.py --device cuda --attention-backend triton --cuda-graphs [--overlap]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
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

from benchmarks.common import LLAMA_TINY, synchronize, tiny_llama_dir

PAGE_SIZE = 16


@dataclass
class _Sink:
    """Timestamps every token of one stream as the frontend hands it out."""

    times: list[float] = field(default_factory=list)
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event) -> None:
        if event is None:
            self.done.set()
            return
        if event.token_ids:
            self.times.extend([time.perf_counter()] * len(event.token_ids))
        if event.error:
            self.error = event.error


class ModelClock:
    """Wraps the decoder's ``forward`` and ``compute_logits`` (instance attributes) and sums
    the wall seconds they take (synchronising the device so the time is the model's own)
    and the CPU seconds of the calling thread in them."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.device = device
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            out = fn(*args, **kwargs)
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return out  # being recorded into a CUDA graph (warm-up): nothing ran
            synchronize(self.device)
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu
            return out
        return timed


class Bench:
    def __init__(self, model_dir: Path, *, device: str, max_streams: int, prompt_len: int, new_tokens: int,
                 overlap: bool, model: dict[str, Any], model_kwargs: dict[str, Any] | None = None):
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        self.prompt_len, self.new_tokens, self.vocab = prompt_len, new_tokens, model["vocab_size"]
        pages = -(-(prompt_len + new_tokens) // PAGE_SIZE)
        config = parse_config({
            "model": "llama", "model_path": str(model_dir), "load_format": "dummy", "device": device,
            "dtype": "float32", "max_seq_len": max(256, prompt_len + new_tokens),
            "max_concurrent_requests": max_streams,
            "resources": {"kv_cache": {"max_num_pages": max_streams * pages, "page_size": PAGE_SIZE}},
            "model_kwargs": {"overlap_scheduling": overlap, **(model_kwargs or {})},
        }, "host overhead config")
        self.deployment = start(config, in_process=True)
        worker = next(iter(self.deployment.runtime.workers.workers.values()))
        self.engine = worker.engines["llm"]
        self.clock = ModelClock(self.engine.model, torch.device(device))
        self.generator = torch.Generator().manual_seed(0)
        self.runs = 0

    def request(self):
        from mstar.model.spec import WalkRequest

        ids = torch.randint(0, self.vocab, (self.prompt_len,), generator=self.generator, dtype=torch.int64)
        params = {"sampling": {"temperature": 0.0}, "max_new_tokens": self.new_tokens,
                  "max_decode_steps": self.new_tokens - 1, "stop_token_ids": []}
        pages = -(-(self.prompt_len + self.new_tokens) // PAGE_SIZE)
        return WalkRequest("chat", {"prompt_ids": ids}, params, {"kv_pages": pages}, prompt_tokens=self.prompt_len)

    def run(self, streams: int) -> dict[str, float]:
        """One batch of ``streams`` requests; host and model time of its decode phase.

        Two measures: wall (engine step to engine step, less the model's wall time) and
        CPU (the conductor thread's CPU time outside the model plus the emit thread's),
        which other load on a shared machine barely moves."""
        d = self.deployment
        self.runs += 1
        sinks = [_Sink() for _ in range(streams)]
        emit_clock = time.pthread_getcpuclockid(d.runtime._threads[1].ident)
        steps: list[tuple[float, float, float, float, float]] = []  # at every engine.run: see below
        original = self.engine.run

        last_prefill = [-1]  # index in steps of the last step that ran a prefill

        def counting_run(items):  # on the conductor thread (in-process workers run plans there)
            if any(item.op != "decode" for item in items):
                last_prefill[0] = len(steps)
            steps.append((time.perf_counter(), self.clock.seconds, time.thread_time(), self.clock.cpu_seconds,
                          time.clock_gettime(emit_clock)))
            return original(items)

        self.engine.run = counting_run
        try:
            for i, sink in enumerate(sinks):
                request = self.request()
                d.runtime.submit(f"host-{self.runs}-{i}", request, d.spec.output_stream(request, []), sink)
            for sink in sinks:
                if not sink.done.wait(600):
                    raise TimeoutError("streams did not finish")
        finally:
            del self.engine.run
        for i, sink in enumerate(sinks):
            if sink.error or len(sink.times) != self.new_tokens:
                raise RuntimeError(f"stream {i}: {len(sink.times)} of {self.new_tokens} tokens, error {sink.error}")
        # decoding only: from the first step after every prompt was prefilled (the frontend may
        # see a first token after later steps ran, so engine steps, not emit times, decide)
        decode = steps[last_prefill[0] + 1:]
        if len(decode) < 2:
            raise RuntimeError(f"only {len(decode)} decode steps after the last prefill: ask for more tokens")
        (t0, model0, cpu0, model_cpu0, emit0), (t1, model1, cpu1, model_cpu1, emit1) = decode[0], decode[-1]
        n = len(decode) - 1
        wall, model_s = t1 - t0, model1 - model0
        host_cpu = (cpu1 - cpu0) - (model_cpu1 - model_cpu0) + (emit1 - emit0)
        return {"steps": n, "wall_ms_per_step": wall / n * 1e3, "model_ms_per_step": model_s / n * 1e3,
                "host_ms_per_step": (wall - model_s) / n * 1e3, "host_cpu_ms_per_step": host_cpu / n * 1e3,
                "host_cpu_us_per_token": host_cpu / (n * streams) * 1e6}

    def close(self) -> None:
        self.deployment.close()


def _profile_threads(bench: Bench, streams: int, top: int) -> str:
    """cProfile top list of one run: the conductor loop's calls (tick, results, the
    in-process worker's plans) and the emit thread's, one profiler behind a lock (cProfile
    is per thread and not thread-safe, so the two threads take turns while profiled)."""
    runtime = bench.deployment.runtime
    prof = cProfile.Profile()
    lock = threading.Lock()

    def profiled(fn):
        def inner(*args, **kwargs):
            with lock:
                return prof.runcall(fn, *args, **kwargs)
        return inner

    targets = [(runtime.conductor, "tick"), (runtime.conductor, "on_result"), (runtime.workers, "send"),
               (runtime, "_emit")]
    for owner, name in targets:
        setattr(owner, name, profiled(getattr(owner, name)))
    try:
        bench.run(streams)
    finally:
        for owner, name in targets:
            delattr(owner, name)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="1,16,64", help="stream counts, comma separated")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="runs per stream count (median reported)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--overlap", action="store_true", help="model_kwargs.overlap_scheduling=true")
    p.add_argument("--attention-backend", choices=("torch", "triton"), default=None,
                   help="model_kwargs.attention_backend (GPU: triton)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="model_kwargs.cuda_graphs=true (decode steps replay a graph: the model clock "
                        "then sees prefills only, so read the wall time per step)")
    p.add_argument("--profile", action="store_true", help="cProfile top list at the largest stream count")
    p.add_argument("--top", type=int, default=30, help="rows of the profile")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _measure(args)
    finally:
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace) -> int:
    streams = sorted({int(s) for s in args.streams.split(",")})
    model = {**LLAMA_TINY, "num_hidden_layers": 1}
    results: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        model_kwargs: dict[str, Any] = {"cuda_graphs": args.cuda_graphs}
        if args.attention_backend:
            model_kwargs["attention_backend"] = args.attention_backend
        bench = Bench(tiny_llama_dir(tmp, **model), device=args.device, max_streams=max(streams),
                      prompt_len=args.prompt_len, new_tokens=args.new_tokens, overlap=args.overlap, model=model,
                      model_kwargs=model_kwargs)
        try:
            for n in streams:  # warm-up
                bench.run(n)
            for n in streams:
                runs = [bench.run(n) for _ in range(args.repeats)]
                results[n] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                r = results[n]
                print(f"{n:3d} streams: host CPU {r['host_cpu_ms_per_step']:.3f} ms/step "
                      f"({r['host_cpu_us_per_token']:.1f} us/token); wall: host {r['host_ms_per_step']:.3f}, "
                      f"model {r['model_ms_per_step']:.3f}, step {r['wall_ms_per_step']:.3f} ms "
                      f"[median of {args.repeats}, {int(r['steps'])} steps]", flush=True)
            if args.profile:
                print(_profile_threads(bench, max(streams), args.top))
        finally:
            bench.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"overlap": args.overlap, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
