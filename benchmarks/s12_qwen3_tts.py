"""S12: Qwen3-TTS 1.7B streaming speech: time to first audio and viability at 1, 8, 32 streams.

Shapes of ``Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice`` (the ``qwen3_tts_1p7b`` key): the talker
(Qwen3 decoder, 28 layers, hidden 2048, 16 heads / 8 KV heads of 128, FFN 6144, codec vocab
3072, text embedding 151936 x 2048), the code predictor (5 layers, hidden 1024, FFN 3072, 15
heads of 2048 codes) and the released 12 Hz codec decoder (16 codebooks, 1920 samples a frame
at 24 kHz). The checkpoint directory is written without weights and served with ``load_format:
dummy``: seeded random weights, the talker in bf16 and the codec in float32 (the family's
default; ``--codec-dtype bfloat16`` for bf16), both on one GPU (one worker: ``node_groups
[talker, codec]``).

Ours is that deployment in process: N streaming speech requests of one fixed text, built by the
family's ``prepare_speech`` and submitted to the runtime at once (as S7 does), timed at the
frontend's sink. Random weights would draw codebook 0's EOS now and then, so the script keeps
EOS masked at every frame (the family masks it for the first ``MIN_FRAMES`` frames; S12 raises
that bound for the run), and every request speaks exactly ``--frames`` frames through the real
talker, code predictor, stream edge (the 1, 3, 8, 16, then 25-frame ramp) and codec.

Rows per stream count N:

* ``ttfa_p50@N`` / ``ttfa_p90@N`` (ms): submit to the first audio sample, over every request
  of every run. Target (issue 28): at most 80 ms at 1 stream.
* ``rtf_min@N`` (x real time): each stream's audio seconds over its own submit-to-last-sample
  time, the slowest stream's.
* ``viable@N`` (streams): streams whose player, started at the first sample, never runs dry
  (S3's definition: every chunk arrives before the audio received ahead of it has played).
  Target: all 32 at 32 streams.
* ``frames_per_s@N``: codec frames made by all N streams over the wall time.

No baseline: the reference package (``qwen-tts==0.1.1``) pins transformers 4.57.3 and cannot run
beside ours (the family's parity fixtures were recorded in a separate environment for that
reason). The **floor** is the weight traffic of one talker step: the talker's layers and
``codec_head`` plus the code predictor's 15 passes (each reading its layers and the input
projection; the 15 heads once) over the measured bandwidth, or the step's FLOPs over the matmul
rate, whichever is larger. One step makes one frame (80 ms of audio) for every stream; TTFA's
floor is the prefill (its code predictor included). The codec is left out of the floor.

``--cuda-graphs``, ``--overlap`` and ``--codec-graphs`` turn on the family's fast path
(``model_kwargs.cuda_graphs``, ``overlap_scheduling``, ``codec_cuda_graphs``); ``--profile``
runs one more batch per stream count under ``torch.profiler`` and records a talker step's host
wall time and its device kernel time. ``--smoke`` runs the same code with the tiny test
checkpoint on the CPU (``--cuda-graphs`` and ``--codec-graphs`` are ignored there: the knobs
need CUDA).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    Metric,
    TimedSink,
    hardware,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    wait_all,
    write_record,
)
from benchmarks.s3_orpheus import StreamTiming

NAME = "s12_qwen3_tts"
SCENARIO = "S12 qwen3-tts-1.7B (in process)"
KEY = "qwen3_tts_1p7b"
SAMPLE_RATE = 24000
FLOAT_BYTES_PER_S = SAMPLE_RATE * 4  # the frontend's float32 mono samples
PAGE_SIZE = 16
VOICE = "ryan"
TEXT = "Hello! This is a benchmark of streaming speech synthesis, one sentence long."
TARGET_TTFA_MS = 80.0  # issue 28: first audio within 80 ms at one stream
TARGET_VIABLE_AT = 32  # ... and every stream viable at 32

log = logging.getLogger("s12")

# Qwen3-TTS-12Hz-1.7B-CustomVoice's talker_config (the codec ids and two of its speakers and
# languages; the other speakers and languages only add rows to the codec embedding)
TALKER_1P7B: dict[str, Any] = {
    "vocab_size": 3072, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "rope_scaling": {"mrope_section": [24, 20, 20], "interleaved": True, "rope_type": "default"},
    "num_code_groups": 16, "text_hidden_size": 2048, "text_vocab_size": 151936,
    "code_predictor_config": {"vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072,
                              "num_hidden_layers": 5, "num_attention_heads": 16, "num_key_value_heads": 8,
                              "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                              "num_code_groups": 16},
    "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
    "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
    "spk_id": {"ryan": 3061, "vivian": 3065}, "spk_is_dialect": {"ryan": False, "vivian": False},
    "codec_language_id": {"english": 2050, "chinese": 2055},
}


@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    streams: tuple[int, ...]
    frames: int
    warmup_frames: int
    runs: int
    seed: int = 0
    cuda_graphs: bool = False
    overlap: bool = False
    codec_graphs: bool = False
    codec_ramp: str = "fixed"
    codec_ramp_margin: float = 0.2
    fused_kernels: bool = False
    codec_dtype: str = "float32"
    profile: bool = False

    def describe(self) -> dict[str, Any]:
        return {"smoke": self.smoke, "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
                "codec_dtype": self.codec_dtype, "key": KEY,
                "talker": "tiny test config" if self.smoke else TALKER_1P7B,
                "codec": "tiny test config" if self.smoke else "released decoder (CodecConfig defaults)",
                "streams": list(self.streams), "frames": self.frames, "warmup_frames": self.warmup_frames,
                "runs": self.runs, "seed": self.seed, "text": TEXT, "voice": VOICE,
                "cuda_graphs": self.cuda_graphs, "overlap_scheduling": self.overlap,
                "codec_cuda_graphs": self.codec_graphs, "codec_ramp": self.codec_ramp,
                "codec_ramp_margin": self.codec_ramp_margin, "fused_kernels": self.fused_kernels,
                "profile": self.profile,
                "eos": "masked at every frame (each request speaks exactly `frames` frames)"}


def settings_from(args: argparse.Namespace) -> Settings:
    streams = tuple(sorted({int(s) for s in args.streams.split(",")})) if args.streams else None
    if args.smoke:
        device, dtype, streams, frames = "cpu", torch.float32, streams or (1, 2), args.frames or 8
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S12 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, streams, frames = "cuda", torch.bfloat16, streams or (1, 8, 32), args.frames or 50
    if frames < 2:
        raise SystemExit("--frames must be at least 2")
    if args.smoke and (args.cuda_graphs or args.codec_graphs or args.fused_kernels):
        log.warning("--cuda-graphs, --codec-graphs and --fused-kernels are ignored on the CPU (the knobs need "
                    "CUDA; the tests run their bucketed paths eagerly and the kernels interpreted)")
    return Settings(smoke=args.smoke, device=device, dtype=dtype, streams=streams, frames=frames,
                    warmup_frames=min(frames, 4 if args.smoke else 30), runs=args.runs, seed=args.seed,
                    cuda_graphs=args.cuda_graphs and not args.smoke, overlap=args.overlap,
                    codec_graphs=args.codec_graphs and not args.smoke, codec_ramp=args.codec_ramp,
                    codec_ramp_margin=args.codec_ramp_margin, fused_kernels=args.fused_kernels and not args.smoke,
                    codec_dtype=args.codec_dtype, profile=args.profile)


# ------------------------------------------------------------------------- checkpoint
def write_model_dir(root: Path, smoke: bool) -> Path:
    """The checkpoint directory without weights: the tiny test one (smoke), or the 1.7B
    CustomVoice config with the released codec decoder and a stand-in tokenizer (byte-level,
    one token per character, the chat and TTS ids of the test tokenizer)."""
    from tests.support import qwen3_tts_dir

    qwen3_tts_dir.write_checkpoint(root, "custom_voice")
    if smoke:
        return root
    config = json.loads((root / "config.json").read_text())
    config.update({"talker_config": TALKER_1P7B, "tts_model_size": "1b7"})
    config.pop("speaker_encoder_config", None)
    (root / "config.json").write_text(json.dumps(config))
    (root / "speech_tokenizer" / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_tts_tokenizer_12hz", "output_sample_rate": SAMPLE_RATE, "decoder_config": {}}))
    return root


# --------------------------------------------------------------------------- the bound
@dataclass(frozen=True)
class Roofline:
    """One talker step's bound (codebook 0 and the code predictor's 15 codes of every stream)."""

    bandwidth_gbs: float
    matmul_tflops: float
    weight_bytes_read: int  # per step
    flops_per_token: float  # per stream and step (one frame)
    samples_per_frame: int

    @staticmethod
    def layer_params(h: int, heads: int, kv: int, head_dim: int, ffn: int) -> tuple[int, int]:
        """(matmul weights, norm weights) of one Qwen3 layer (q/k norms included)."""
        return 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * ffn, 2 * h + 2 * head_dim

    @classmethod
    def of(cls, tts, samples_per_frame: int, dtype: torch.dtype, bandwidth_gbs: float,
           matmul_tflops: float) -> Roofline:
        talker, pred, groups = tts.talker.text, tts.talker.predictor, tts.talker.num_code_groups
        t_mm, t_norm = cls.layer_params(talker.hidden_size, talker.num_attention_heads, talker.num_key_value_heads,
                                        talker.head_dim, talker.intermediate_size)
        p_mm, p_norm = cls.layer_params(pred.hidden_size, pred.num_attention_heads, pred.num_key_value_heads,
                                        pred.head_dim, pred.intermediate_size)
        head = talker.hidden_size * talker.vocab_size  # codec_head
        talker_mm = talker.num_hidden_layers * t_mm + head
        talker_all = talker_mm + talker.num_hidden_layers * t_norm + talker.hidden_size
        proj = (talker.hidden_size + 1) * pred.hidden_size if talker.hidden_size != pred.hidden_size else 0
        passes = groups - 1  # the predictor's prefill (2 rows) and 14 decodes
        pred_pass_mm = pred.num_hidden_layers * p_mm + proj
        pred_pass = pred_pass_mm + pred.num_hidden_layers * p_norm + pred.hidden_size
        heads = passes * pred.hidden_size * pred.vocab_size  # lm_head[0..14], each read once
        weights = talker_all + passes * pred_pass + heads
        flops = 2.0 * (talker_mm + (passes + 1) * pred_pass_mm + heads)  # the prefill pass reads two rows
        return cls(bandwidth_gbs, matmul_tflops, weights * (torch.finfo(dtype).bits // 8), flops, samples_per_frame)

    def step_s(self, tokens: int) -> float:
        """Least time of one talker step over ``tokens`` rows (decode: one per stream)."""
        return max(self.weight_bytes_read / (self.bandwidth_gbs * 1e9),
                   tokens * self.flops_per_token / (self.matmul_tflops * 1e12))

    @property
    def frame_s(self) -> float:
        """Seconds of audio one frame plays."""
        return self.samples_per_frame / SAMPLE_RATE


# ------------------------------------------------------------------------------- ours
@contextmanager
def eos_masked():
    """Codebook 0 never draws EOS while this holds (in process: the talker's rules read the
    family's ``MIN_FRAMES`` at every step)."""
    from mstar.model.qwen3_tts import engine

    saved = engine.MIN_FRAMES
    engine.MIN_FRAMES = 1 << 30
    try:
        yield
    finally:
        engine.MIN_FRAMES = saved


def deployment(settings: Settings, model_dir: Path) -> dict[str, Any]:
    """The deployment S12 serves (the YAML's keys): ``configs/qwen3_tts_1p7b.yaml`` on the
    written directory with dummy weights, pages for every stream at once."""
    max_seq_len = 256 + settings.frames  # the prompt (92 rows of TEXT) and every frame
    pages = -(-max_seq_len // PAGE_SIZE)
    return {"model": KEY, "model_path": str(model_dir), "load_format": "dummy", "device": settings.device,
            "dtype": str(settings.dtype).removeprefix("torch."), "max_seq_len": max_seq_len,
            "max_concurrent_requests": max(settings.streams),
            "node_groups": [{"node_names": ["talker", "codec"], "ranks": [0]}],
            "resources": {"kv_cache": {"max_num_pages": max(settings.streams) * pages + 8, "page_size": PAGE_SIZE}},
            "model_kwargs": {"max_new_frames": settings.frames, "codec_chunk_schedule": [1, 3, 8, 16],
                             "codec_chunk_frames": 25, "codec_left_context": 72, "seed": settings.seed,
                             "cuda_graphs": settings.cuda_graphs, "overlap_scheduling": settings.overlap,
                             "codec_cuda_graphs": settings.codec_graphs, "codec_ramp": settings.codec_ramp,
                             "codec_ramp_margin": settings.codec_ramp_margin,
                             "fused_kernels": settings.fused_kernels, "codec_dtype": settings.codec_dtype}}


class OursRunner:
    """The in-process deployment; ``run(n, frames)`` times ``n`` requests sent at once."""

    def __init__(self, settings: Settings, model_dir: Path):
        import mstar.model.qwen3_tts.model  # noqa: F401  (registers the family)
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        self.config = deployment(settings, model_dir)
        self.deployment = start(parse_config(self.config, "s12 qwen3_tts config"), in_process=True)
        self.samples_per_frame = self.deployment.spec.checkpoint().codec_config().samples_per_frame
        self.runs = 0

    def prompt_rows(self, frames: int) -> int:
        from mstar.contract import SpeechSpec

        request = self.deployment.spec.prepare_speech(SpeechSpec("s12-rows", TEXT, VOICE, 1.0, {"max_tokens": frames}))
        return request.prompt_tokens

    def run(self, n: int, frames: int, seed: int, timeout_s: float = 600.0) -> tuple[float, list[StreamTiming]]:
        """The wall time to the last sample and each stream's timing; raises unless every
        stream spoke exactly ``frames`` frames."""
        from mstar.contract import SpeechSpec

        self.runs += 1
        spec = self.deployment.spec
        specs = [SpeechSpec(f"s12-{self.runs}-{i}", TEXT, VOICE, 1.0, {"seed": seed + i, "max_tokens": frames},
                            stream=True) for i in range(n)]
        requests = [spec.prepare_speech(s) for s in specs]
        sinks = [TimedSink() for _ in specs]
        start = time.perf_counter()
        for s, request, sink in zip(specs, requests, sinks):
            sink.submitted = time.perf_counter()
            self.deployment.runtime.submit(s.request_id, request, spec.output_stream(request, []), sink)
        wait_all(sinks, timeout_s)
        wall = time.perf_counter() - start
        expected = frames * self.samples_per_frame * 4
        for i, sink in enumerate(sinks):
            if sink.error or sink.finish_reason not in ("stop", "length") or sink.data_bytes != expected:
                raise RuntimeError(f"request {i}: finish {sink.finish_reason!r}, error {sink.error!r}, "
                                   f"{sink.data_bytes} audio bytes (expected {expected})")
        return wall, [StreamTiming(s.submitted, s.first_data, s.data_times[-1], s.data_bytes,
                                   list(zip(s.data_times, s.data_sizes))) for s in sinks]

    def close(self) -> None:
        self.deployment.close()
        del self.deployment


def percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of ``ordered`` (sorted) by the nearest rank: the smallest value with
    at least ``q`` of the values at or below it (so p90 of a few values is never below p50)."""
    return ordered[max(0, min(len(ordered), math.ceil(q * len(ordered))) - 1)]


def first_dry(timing: StreamTiming, bytes_per_s: float) -> tuple[int, float] | None:
    """Where a player started at the first sample first runs dry: the late chunk's index and
    how late it came (ms), or None (``StreamTiming.viable``'s rule)."""
    start, received = timing.arrivals[0][0], 0
    for index, (at, size) in enumerate(timing.arrivals):
        late = at - start - received / bytes_per_s
        if late > 0:
            return index, 1e3 * late
        received += size
    return None


def dry_report(timings: list[StreamTiming]) -> dict[str, Any]:
    """Which chunk first ran each player dry, how late, and one such stream's chunks (ms after
    its first audio, ms of audio): what the next run needs to tell a ramp's fault from a slow
    batch."""
    dry = [(t, first_dry(t, FLOAT_BYTES_PER_S)) for t in timings if t.arrivals]
    dry = [(t, d) for t, d in dry if d is not None]
    if not dry:
        return {}
    late = sorted(ms for _, (_, ms) in dry)
    first = dry[0][0]
    chunks = [(round(1e3 * (at - first.arrivals[0][0]), 1), round(1e3 * size / FLOAT_BYTES_PER_S, 1))
              for at, size in first.arrivals]
    return {"first_dry_chunk": dict(sorted(Counter(i for _, (i, _) in dry).items())),
            "late_ms_p50": statistics.median(late), "late_ms_max": late[-1], "a_dry_stream_chunks": chunks}


def summarise(n: int, frames: int, frame_s: float, runs: list[tuple[float, list[StreamTiming]]]) -> dict[str, Any]:
    """One stream count's figures over every request of every run."""
    timings = [t for _, ts in runs for t in ts]
    ttfa = sorted(t.first_audio - t.sent for t in timings)
    audio_s = frames * frame_s
    per_stream = [audio_s / (t.end - t.sent) for t in timings]
    viable = [t.viable(FLOAT_BYTES_PER_S) for t in timings]
    walls = [wall for wall, _ in runs]
    return {"ttfa_ms_p50": 1e3 * statistics.median(ttfa), "ttfa_ms_p90": 1e3 * percentile(ttfa, 0.9),
            "ttfa_ms_max": 1e3 * ttfa[-1], "rtf_min": min(per_stream), "rtf_median": statistics.median(per_stream),
            "viable_streams": sum(viable) / len(runs), "viable_share": sum(viable) / len(viable),
            "frames_per_s": n * frames / statistics.median(walls), "wall_s": walls, "audio_s_per_stream": audio_s,
            "chunks_per_stream": statistics.median(len(t.arrivals) for t in timings), "dry": dry_report(timings)}


@contextmanager
def wrapped(cls: type, name: str, wrapper):
    """``cls.<name>`` replaced by ``wrapper(original)`` while this holds. The deployment runs
    in this process (``in_process``), so patching a class reaches its engines and conductor."""
    original = getattr(cls, name)
    setattr(cls, name, wrapper(original))
    try:
        yield
    finally:
        setattr(cls, name, original)


@contextmanager
def step_profile(device: torch.device):
    """Host and device time of the talker's steps while this holds: each ``TalkerEngine.run``
    call's wall time on the host, and (CUDA) the GPU kernels' time over the same span from
    ``torch.profiler``. Yields a dict filled in at the exit: ``steps``, ``host_ms_per_step``
    (a step's wall time, waiting for the device included), ``device_ms_per_step`` (kernel time
    of everything that ran, the codec's included, over the steps)."""
    from mstar.model.qwen3_tts.engine import TalkerEngine

    walls: list[float] = []

    def timing(original):
        def timed(self, items):
            t0 = time.perf_counter()
            try:
                return original(self, items)
            finally:
                walls.append(time.perf_counter() - t0)
        return timed

    result: dict[str, Any] = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with wrapped(TalkerEngine, "run", timing), torch.profiler.profile(activities=activities) as prof:
        yield result
    steps = max(len(walls), 1)
    result.update({"steps": len(walls), "host_ms_per_step": 1e3 * sum(walls) / steps})
    if device.type == "cuda":
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages()
                        if e.device_type == torch.autograd.DeviceType.CUDA)
        result["device_ms_per_step"] = kernel_us / 1e3 / steps
    log.info("profile: %s", result)


@contextmanager
def ramp_trace():
    """The windows the adaptive ramp releases while this holds: ``(time, view, frames)`` per
    release, ``view`` being what the rule saw (``mstar.model.qwen3_tts.ramp.RampView``), from
    ``RampRule.release`` wrapped in the conductor's process."""
    from mstar.model.qwen3_tts.ramp import RampRule

    entries: list[tuple[float, Any, int]] = []
    seen: set = set()

    def tracing(original):
        def traced(self, view):
            size = original(self, view)
            if size and (view, size) not in seen:  # asked again in one tick (``StreamState.drained``)
                seen.add((view, size))
                entries.append((time.perf_counter(), view, size))
            return size
        return traced

    with wrapped(RampRule, "release", tracing):
        yield entries


def ramp_report(entries: list[tuple[float, Any, int]], start: float, windows: int = 4) -> dict[str, Any]:
    """The first ``windows`` windows of every stream, by index: the sizes chosen, and [min,
    median, max] over the streams of when (ms after ``start``), the rate and codec time the
    rule assumed, the player's buffer and the frames made: where an estimate was off."""
    def spread(values: list[float | None]) -> list[float] | None:
        known = sorted(v for v in values if v is not None)
        return [round(known[0], 1), round(statistics.median(known), 1), round(known[-1], 1)] if known else None

    out: dict[str, Any] = {}
    for index in range(windows):
        rows = [(at, view, size) for at, view, size in entries if view.windows == index]
        if rows:
            out[str(index)] = {"sizes": dict(sorted(Counter(size for _, _, size in rows).items())),
                               "at_ms": spread([1e3 * (at - start) for at, _, _ in rows]),
                               "frame_ms": spread([view.frame_ms for _, view, _ in rows]),
                               "codec_ms": spread([view.codec_ms for _, view, _ in rows]),
                               "buffer_ms": spread([view.released_ms - view.played_ms for _, view, _ in rows]),
                               "produced": spread([view.produced for _, view, _ in rows])}
    return out


def run_ours(settings: Settings, model_dir: Path) -> tuple[dict[str, Any], int, int]:
    """Every stream count (after one warm-up pass over them); the figures, the prompt's rows
    and the samples per frame."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    runner = OursRunner(settings, model_dir)
    out["startup_s"] = time.perf_counter() - t0
    log.info("ours: deployment up in %.1f s", out["startup_s"])
    frame_s = runner.samples_per_frame / SAMPLE_RATE
    try:
        rows = runner.prompt_rows(settings.frames)
        with eos_masked():
            t0 = time.perf_counter()
            for n in settings.streams:
                runner.run(n, settings.warmup_frames, settings.seed)
            out["warmup_s"] = time.perf_counter() - t0
            for n in settings.streams:
                runs, ramp = [], {}
                for r in range(settings.runs):  # the first run's ramp decisions are traced
                    traced = settings.codec_ramp == "adaptive" and r == 0
                    with ramp_trace() if traced else nullcontext([]) as entries:
                        start = time.perf_counter()
                        runs.append(runner.run(n, settings.frames, settings.seed + 1000 * (r + 1)))
                    ramp = ramp_report(entries, start) if entries else ramp
                out[n] = summarise(n, settings.frames, frame_s, runs)
                if ramp:
                    out[n]["ramp"] = ramp
                if settings.profile:  # one more batch, profiled (its timing is not in the figures)
                    with step_profile(torch.device(settings.device)) as prof:
                        runner.run(n, settings.frames, settings.seed)
                    out[n]["profile"] = prof
                log.info("ours: %d stream(s): TTFA p50 %.0f ms (p90 %.0f), slowest stream %.2fx real time, "
                         "%g/%d viable, %.0f frames/s", n, out[n]["ttfa_ms_p50"], out[n]["ttfa_ms_p90"],
                         out[n]["rtf_min"], out[n]["viable_streams"], n, out[n]["frames_per_s"])
    finally:
        runner.close()
    return out, rows, runner.samples_per_frame


# ---------------------------------------------------------------------------- report
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny model, CPU)" if settings.smoke else SCENARIO


BASELINE_NOTE = ("none: qwen-tts==0.1.1 pins transformers 4.57.3, which cannot run beside this stack's "
                 "transformers (the family's parity fixtures were recorded in a separate environment)")


def metrics_from(settings: Settings, roof: Roofline, prompt_rows: int, ours: dict | None) -> list[Metric]:
    rows = []
    scenario = scenario_name(settings)
    for n in settings.streams:
        step = roof.step_s(n)
        ttfa_floor = roof.step_s(n * prompt_rows) * 1e3  # the first window needs the prefill's frame only
        got = (ours or {}).get(n)
        metrics = [
            Metric(scenario, f"ttfa_p50@{n}", "ms", "lower", got and got["ttfa_ms_p50"], floor=ttfa_floor),
            Metric(scenario, f"ttfa_p90@{n}", "ms", "lower", got and got["ttfa_ms_p90"], floor=ttfa_floor),
            Metric(scenario, f"rtf_min@{n}", "x real time", "higher", got and got["rtf_min"],
                   floor=roof.frame_s / step),
            Metric(scenario, f"viable@{n}", "streams", "higher", got and got["viable_streams"], floor=float(n)),
            Metric(scenario, f"frames_per_s@{n}", "frames/s", "higher", got and got["frames_per_s"], floor=n / step),
        ]
        for m in metrics:
            m.notes["baseline"] = BASELINE_NOTE
            if got:
                m.notes.update({f"ours_{k}": v for k, v in got.items()})
        if n == 1 and got:
            metrics[0].notes["target_ms"] = TARGET_TTFA_MS
            metrics[0].notes["meets_target"] = got["ttfa_ms_p50"] <= TARGET_TTFA_MS
        if n == TARGET_VIABLE_AT and got:
            metrics[3].notes["meets_target"] = got["viable_share"] == 1.0
        rows += metrics
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the code paths)")
    p.add_argument("--streams", default=None, help="concurrent requests, comma separated (default 1,8,32; smoke 1,2)")
    p.add_argument("--frames", type=int, default=None,
                   help="codec frames per request, 12.5 a second (default 50 = 4 s; smoke 8)")
    p.add_argument("--runs", type=int, default=1, help="timed batches per stream count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="model_kwargs.cuda_graphs: the talker step and the code predictor's frame from CUDA graphs")
    p.add_argument("--overlap", action="store_true",
                   help="model_kwargs.overlap_scheduling: launch talker step k+1 before step k's codes are read")
    p.add_argument("--codec-graphs", action="store_true",
                   help="model_kwargs.codec_cuda_graphs: the codec's windows from CUDA graphs per shape")
    p.add_argument("--codec-ramp", choices=("fixed", "adaptive"), default="fixed",
                   help="model_kwargs.codec_ramp: the fixed 1/3/8/16/25 windows, or sized from each stream's rate")
    p.add_argument("--codec-ramp-margin", type=float, default=0.2,
                   help="model_kwargs.codec_ramp_margin (adaptive): a window's wait padded by this share of itself")
    p.add_argument("--fused-kernels", action="store_true",
                   help="model_kwargs.fused_kernels: the talker's and predictor's layers as Llama's fused kernels")
    p.add_argument("--codec-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model_kwargs.codec_dtype: the codec decoder's dtype")
    p.add_argument("--profile", action="store_true",
                   help="after each stream count's runs, one more profiled: host vs device ms per talker step")
    p.add_argument("--out", default=None, help="directory of the JSON record (default $OUT, else benchmarks/results)")
    p.add_argument("--verbose", action="store_true", help="log M* at INFO level")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("mstar").setLevel(logging.WARNING)
    settings = settings_from(args)
    device = torch.device(settings.device)
    started = time.perf_counter()
    log.info("S12 settings: %s", settings.describe())

    bandwidth = measure_memory_bandwidth(device)
    tflops = measure_matmul_tflops(device, settings.dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # leave the GPU to the deployment
    with tempfile.TemporaryDirectory(prefix="s12-qwen3-tts-") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", settings.smoke)
        from mstar.model.qwen3_tts.checkpoint import Qwen3TTSCheckpoint

        ckpt = Qwen3TTSCheckpoint.locate(str(model_dir), dummy=True)
        roof = Roofline.of(ckpt.config(), ckpt.codec_config().samples_per_frame, settings.dtype, bandwidth, tflops)
        log.info("measured %.0f GB/s, %.1f TFLOP/s; %.2f GB of weights per talker step (floor %.2f ms)",
                 bandwidth, tflops, roof.weight_bytes_read / 1e9, roof.step_s(1) * 1e3)
        ours, prompt_rows, _ = run_ours(settings, model_dir)

    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"memory_bandwidth_gbs": bandwidth, "matmul_tflops": tflops,
                     "weight_bytes_read_per_step": roof.weight_bytes_read, "flops_per_frame": roof.flops_per_token,
                     "prompt_rows": prompt_rows, "samples_per_frame": roof.samples_per_frame,
                     "first_window_frames": 1, "codec": "not in the floor"},
        "metrics": metrics_from(settings, roof, prompt_rows, ours),
        "ours": {str(k): v for k, v in ours.items()},
        "baseline": None,
        "baseline_missing": BASELINE_NOTE,
        "errors": {},
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S12 done in %.1f s", record["total_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
