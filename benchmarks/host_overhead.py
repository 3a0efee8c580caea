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

``--model orpheus``: the same for S3's deployment, an in-process ``orpheus`` with a tiny
one-layer talker (Orpheus's vocabulary of 156940 ids, random weights) and a tiny SNAC codec
(``SNAC_TINY`` of benchmarks/s3_orpheus.py), under the benchmarking knob
``benchmark_audio_only``: N streaming speech requests at once (S3's sampling: temperature
0.6, top-p 0.8, repetition penalty 1.1, a seed each), every token an audio code, the codec's
windows flowing over the stream edge as in serving, the audio fed to the client's PCM
stream. The talker's ``forward`` / ``compute_logits`` and the codec's decode are the model
time; its sampling (the penalty, the code restriction and the draw over 156940 ids, a few
kernels a step on a GPU but milliseconds of arithmetic per row on the CPU) is timed apart
too and left out of the host figures (the ``sampling`` column).

    python benchmarks/host_overhead.py                      # 1, 16, 64 streams
    python benchmarks/host_overhead.py --model orpheus      # 1, 8, 32 streams
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
    """Timestamps every token of one stream as the frontend hands it out, and counts its
    audio samples (float32 PCM)."""

    times: list[float] = field(default_factory=list)
    samples: int = 0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event) -> None:
        if event is None:
            self.done.set()
            return
        if event.token_ids:
            self.times.extend([time.perf_counter()] * len(event.token_ids))
        if event.data:
            self.samples += len(event.data) // 4
        if event.error:
            self.error = event.error


class ModelClock:
    """Wraps callables (``wrap``: an instance's method or a module's function) and sums the
    wall seconds they take (synchronising the device so the time is their own) and the CPU
    seconds of the calling thread in them. The llama deployment's clock wraps the decoder's
    ``forward`` and ``compute_logits``. While ``profiler`` profiles the calling thread, it
    is paused in the timed calls, so that its list holds the host work alone."""

    def __init__(self, device: torch.device, *targets: tuple[Any, str]):
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.device = device
        self.profiler: cProfile.Profile | None = None
        self._wrapped: list[tuple[Any, str, Any]] = []
        for owner, name in targets:
            self.wrap(owner, name)

    def wrap(self, owner: Any, name: str) -> None:
        self._wrapped.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, self._timed(getattr(owner, name)))

    def unwrap(self) -> None:
        for owner, name, before in reversed(self._wrapped):
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self._wrapped.clear()

    def _timed(self, fn):
        def timed(*args, **kwargs):
            profiler = self.profiler if self.profiler is not None and sys.getprofile() is self.profiler else None
            if profiler is not None:
                profiler.disable()
            try:
                start, cpu = time.perf_counter(), time.thread_time()
                out = fn(*args, **kwargs)
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    return out  # being recorded into a CUDA graph (warm-up): nothing ran
                synchronize(self.device)
                self.seconds += time.perf_counter() - start
                self.cpu_seconds += time.thread_time() - cpu
                return out
            finally:
                if profiler is not None:
                    profiler.enable()
        return timed


class Bench:
    """The ``llama`` deployment: N chat walks of ``prompt_len`` random ids, greedy, EOS
    ignored, ``new_tokens`` each; its clock times the decoder."""

    def __init__(self, model_dir: Path, *, device: str, max_streams: int, prompt_len: int, new_tokens: int,
                 overlap: bool, model: dict[str, Any], model_kwargs: dict[str, Any] | None = None):
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        self.prompt_len, self.new_tokens, self.vocab = prompt_len, new_tokens, model["vocab_size"]
        self.device = torch.device(device)
        config = parse_config(self.config(model_dir, device, max_streams, {
            "overlap_scheduling": overlap, **(model_kwargs or {})}), "host overhead config")
        self.deployment = start(config, in_process=True)
        worker = next(iter(self.deployment.runtime.workers.workers.values()))
        self.engines = worker.engines
        self.engine = worker.engines["llm"]
        self.clock = ModelClock(self.device, (self.engine.model, "forward"), (self.engine.model, "compute_logits"))
        self.sampling = ModelClock(self.device)  # timed apart from the host work (none here)
        self.generator = torch.Generator().manual_seed(0)
        self.runs = 0

    def config(self, model_dir: Path, device: str, max_streams: int, model_kwargs: dict[str, Any]) -> dict:
        pages = -(-(self.prompt_len + self.new_tokens) // PAGE_SIZE)
        return {
            "model": "llama", "model_path": str(model_dir), "load_format": "dummy", "device": device,
            "dtype": "float32", "max_seq_len": max(256, self.prompt_len + self.new_tokens),
            "max_concurrent_requests": max_streams,
            "resources": {"kv_cache": {"max_num_pages": max_streams * pages, "page_size": PAGE_SIZE}},
            "model_kwargs": model_kwargs,
        }

    def request(self, request_id: str):
        """A stream's walk request and output stream."""
        from mstar.model.spec import WalkRequest

        ids = torch.randint(0, self.vocab, (self.prompt_len,), generator=self.generator, dtype=torch.int64)
        params = {"sampling": {"temperature": 0.0}, "max_new_tokens": self.new_tokens,
                  "max_decode_steps": self.new_tokens - 1, "stop_token_ids": []}
        pages = -(-(self.prompt_len + self.new_tokens) // PAGE_SIZE)
        request = WalkRequest("chat", {"prompt_ids": ids}, params, {"kv_pages": pages}, prompt_tokens=self.prompt_len)
        return request, self.deployment.spec.output_stream(request, [])

    def check(self, i: int, sink: _Sink) -> None:
        if sink.error or len(sink.times) != self.new_tokens:
            raise RuntimeError(f"stream {i}: {len(sink.times)} of {self.new_tokens} tokens, error {sink.error}")

    def run(self, streams: int) -> dict[str, float]:
        """One batch of ``streams`` requests; host and model time of its decode phase.

        Two measures: wall (engine step to engine step, less the model's wall time) and
        CPU (the conductor thread's CPU time outside the model plus the emit thread's),
        which other load on a shared machine barely moves. Time in ``self.sampling`` is
        left out of both like the model's."""
        d = self.deployment
        self.runs += 1
        sinks = [_Sink() for _ in range(streams)]
        emit_clock = time.pthread_getcpuclockid(d.runtime._threads[1].ident)
        steps: list[tuple[float, ...]] = []  # at every engine.run: see below
        original = self.engine.run

        last_prefill = [-1]  # index in steps of the last step that ran a prefill

        def counting_run(items):  # on the conductor thread (in-process workers run plans there)
            if any(item.op != "decode" for item in items):
                last_prefill[0] = len(steps)
            steps.append((time.perf_counter(), self.clock.seconds + self.sampling.seconds, time.thread_time(),
                          self.clock.cpu_seconds + self.sampling.cpu_seconds, time.clock_gettime(emit_clock),
                          self.sampling.seconds))
            return original(items)

        self.engine.run = counting_run
        try:
            for i, sink in enumerate(sinks):
                request, stream = self.request(f"host-{self.runs}-{i}")
                d.runtime.submit(f"host-{self.runs}-{i}", request, stream, sink)
            for sink in sinks:
                if not sink.done.wait(600):
                    raise TimeoutError("streams did not finish")
        finally:
            del self.engine.run
        for i, sink in enumerate(sinks):
            self.check(i, sink)
        # decoding only: from the first step after every prompt was prefilled (the frontend may
        # see a first token after later steps ran, so engine steps, not emit times, decide)
        decode = steps[last_prefill[0] + 1:]
        if len(decode) < 2:
            raise RuntimeError(f"only {len(decode)} decode steps after the last prefill: ask for more tokens")
        (t0, model0, cpu0, model_cpu0, emit0, sampling0), (t1, model1, cpu1, model_cpu1, emit1, sampling1) = (
            decode[0], decode[-1])
        n = len(decode) - 1
        wall, model_s, sampling_s = t1 - t0, model1 - model0, sampling1 - sampling0
        host_cpu = (cpu1 - cpu0) - (model_cpu1 - model_cpu0) + (emit1 - emit0)
        return {"steps": n, "wall_ms_per_step": wall / n * 1e3, "model_ms_per_step": (model_s - sampling_s) / n * 1e3,
                "sampling_ms_per_step": sampling_s / n * 1e3,
                "host_ms_per_step": (wall - model_s) / n * 1e3, "host_cpu_ms_per_step": host_cpu / n * 1e3,
                "host_cpu_us_per_token": host_cpu / (n * streams) * 1e6}

    def close(self) -> None:
        self.clock.unwrap()
        self.sampling.unwrap()
        self.deployment.close()


class OrpheusBench(Bench):
    """The ``orpheus`` deployment as S3 serves it (``benchmark_audio_only``), tiny: N speech
    requests of ``new_tokens`` audio codes each, S3's sampling, a seed per stream. The model
    clock times the talker's decoder and the codec's decode of a batch of windows; the
    sampling clock the talker's sampling (``engine.sample``) and its restriction to the
    audio codes."""

    def __init__(self, model_dir: Path, *, device: str, max_streams: int, new_tokens: int, overlap: bool,
                 snac: dict[str, Any], model_kwargs: dict[str, Any] | None = None):
        from mstar.model.orpheus import engine as talk

        self.snac = snac
        super().__init__(model_dir, device=device, max_streams=max_streams, prompt_len=0, new_tokens=new_tokens,
                         overlap=overlap, model={"vocab_size": 0}, model_kwargs=model_kwargs)
        self.clock.wrap(talk, "decode_frames")  # the codec node's decode of its windows (a module function)
        self.sampling.wrap(self.engine, "sample")
        self.sampling.wrap(talk, "restrict_to_audio_codes")

    def config(self, model_dir: Path, device: str, max_streams: int, model_kwargs: dict[str, Any]) -> dict:
        prompt_room = 64
        pages = -(-(prompt_room + self.new_tokens) // PAGE_SIZE)
        return {
            "model": "orpheus", "model_path": str(model_dir), "load_format": "dummy", "device": device,
            "dtype": "float32", "max_seq_len": max(256, prompt_room + self.new_tokens),
            "max_concurrent_requests": max_streams,
            "resources": {"kv_cache": {"max_num_pages": max_streams * pages + 8, "page_size": PAGE_SIZE}},
            "model_kwargs": {"benchmark_audio_only": True, "max_new_tokens": self.new_tokens,
                             "snac_config": self.snac, **model_kwargs},
        }

    def request(self, request_id: str):
        from benchmarks.s3_orpheus import TEXT
        from mstar.contract import SpeechSpec

        spec = self.deployment.spec
        seed = sum(map(ord, request_id))  # a seed per stream, the same in every run
        request = spec.prepare_speech(SpeechSpec(request_id, TEXT, "tara", 1.0,
                                                 {"max_tokens": self.new_tokens, "seed": seed}))
        return request, spec.output_stream(request, [])

    def check(self, i: int, sink: _Sink) -> None:
        from mstar.model.orpheus import engine as talk

        want = self.new_tokens // talk.TOKENS_PER_FRAME * talk.SAMPLES_PER_FRAME
        if sink.error or sink.samples != want:
            raise RuntimeError(f"stream {i}: {sink.samples} of {want} samples, error {sink.error}")


def _profile_threads(bench: Bench, streams: int, top: int, dump: str | None = None) -> str:
    """cProfile top list of one run: the conductor loop's calls (tick, results and their emits,
    in-process worker's plans) and the emit thread's, one profiler behind a lock (cProfile
    is per thread and not thread-safe, so the two threads take turns while profiled). The
    clocked calls (model, sampling) are left out: the list is of host work, by own time (a
    frame's cumulative time stops counting at the first clocked call below it)."""
    runtime = bench.deployment.runtime
    prof = cProfile.Profile(time.thread_time)  # CPU time: waits for the GIL and other load left out
    bench.clock.profiler = bench.sampling.profiler = prof
    lock = threading.Lock()

    def profiled(fn):
        def inner(*args, **kwargs):
            with lock:
                return prof.runcall(fn, *args, **kwargs)
        return inner

    targets = [(runtime.conductor, "tick"), (runtime.conductor, "on_result"), (runtime.workers, "send"),
               (runtime, "_expect_emits"), (runtime, "_settle_emits"), (runtime, "_emit")]
    for owner, name in targets:
        setattr(owner, name, profiled(getattr(owner, name)))
    try:
        bench.run(streams)
    finally:
        for owner, name in targets:
            delattr(owner, name)
        bench.clock.profiler = bench.sampling.profiler = None
    if dump:
        prof.dump_stats(dump)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("llama", "orpheus"), default="llama",
                   help="llama: chat decoding; orpheus: S3's speech streams (talker + SNAC windows)")
    p.add_argument("--streams", default=None, help="stream counts, comma separated (llama 1,16,64; orpheus 1,8,32)")
    p.add_argument("--prompt-len", type=int, default=16, help="llama: prompt ids")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens a stream decodes (llama 64; orpheus 70, audio codes, a multiple of 7)")
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
    p.add_argument("--profile-dump", default=None, help="also write the profile's pstats to this file")
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


def _bench(args: argparse.Namespace, tmp: str, max_streams: int) -> Bench:
    model_kwargs: dict[str, Any] = {"cuda_graphs": args.cuda_graphs}
    if args.attention_backend:
        model_kwargs["attention_backend"] = args.attention_backend
    if args.model == "orpheus":
        from benchmarks.s3_orpheus import ORPHEUS_TINY, SNAC_TINY

        tokens = args.new_tokens or 70
        if tokens < 28 or tokens % 7:
            raise SystemExit("--new-tokens: orpheus streams speak whole frames, a multiple of 7, at least 28")
        model = {**ORPHEUS_TINY, "num_hidden_layers": 1}
        return OrpheusBench(tiny_llama_dir(tmp, **model), device=args.device, max_streams=max_streams,
                            new_tokens=tokens, overlap=args.overlap, snac=SNAC_TINY, model_kwargs=model_kwargs)
    model = {**LLAMA_TINY, "num_hidden_layers": 1}
    return Bench(tiny_llama_dir(tmp, **model), device=args.device, max_streams=max_streams,
                 prompt_len=args.prompt_len, new_tokens=args.new_tokens or 64, overlap=args.overlap, model=model,
                 model_kwargs=model_kwargs)


def _measure(args: argparse.Namespace) -> int:
    default = "1,8,32" if args.model == "orpheus" else "1,16,64"
    streams = sorted({int(s) for s in (args.streams or default).split(",")})
    results: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        bench = _bench(args, tmp, max(streams))
        try:
            for n in streams:  # warm-up
                bench.run(n)
            for n in streams:
                runs = [bench.run(n) for _ in range(args.repeats)]
                results[n] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                r = results[n]
                print(f"{n:3d} streams: host CPU {r['host_cpu_ms_per_step']:.3f} ms/step "
                      f"({r['host_cpu_us_per_token']:.1f} us/token); wall: host {r['host_ms_per_step']:.3f}, "
                      f"model {r['model_ms_per_step']:.3f}, "
                      + (f"sampling {r['sampling_ms_per_step']:.3f}, " if r["sampling_ms_per_step"] else "")
                      + f"step {r['wall_ms_per_step']:.3f} ms "
                      f"[median of {args.repeats}, {int(r['steps'])} steps]", flush=True)
            if args.profile:
                print(_profile_threads(bench, max(streams), args.top, args.profile_dump))
        finally:
            bench.close()
    if args.json:
        record = {"model": args.model, "overlap": args.overlap, "results": results}
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
