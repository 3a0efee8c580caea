"""S6: Parakeet TDT 0.6B v3 speech recognition: real-time factor of 30 s clips, against transformers.

parakeet-tdt-0.6b-v3 shapes (FastConformer encoder: 24 layers, hidden 1024, 8 heads, FFN 4096,
128 mel bins, 8x subsampling; TDT head: 2-layer LSTM of 640, joint over 8192 tokens + blank and
durations 0-4), random weights, bf16 on one GPU. One checkpoint serves both sides:
transformers' ``ParakeetForTDT`` is built at that config (seeded random init), saved in the
released layout (``save_pretrained``: config.json, safetensors, generation and processor
configs, a tokenizer), and our deployment loads that directory, so both decode the same
weights and their transcripts compare token for token.

* **ours**: an in-process ``parakeet`` deployment: each clip's ``transcribe`` walk (encoder,
  then a Loop of decode iterations of ``steps_per_iteration`` greedy steps) is built by the
  model's own ``clip_request`` (log-mel on the CPU, outside the timing) and submitted straight
  to the runtime, as the transcription route does; N clips at once. On CUDA its decode
  iterations replay CUDA graphs (``model_kwargs.cuda_graphs``; ``--no-cuda-graphs``: eager).
* **baseline**: transformers ``ParakeetForTDT.generate`` on the same N clips as one batch, on
  the processor's features (``ParakeetFeatureExtractor``, computed before the clock starts).
* **floor**: the encoder's FLOPs over the GPU's dense bf16 peak (or its weights over the peak
  bandwidth, whichever is longer) plus, for the greedy steps a clip needs at least, the decoder
  and joint weights over the bandwidth (or N steps' FLOPs over the peak).

Clips are 30 s of deterministic speech-like noise (a syllable-rate envelope over voiced tones
and noise); the metric is audio seconds transcribed per wall second (x real time, higher is
better). ``--smoke`` runs the same code paths with a tiny model on the CPU.
See benchmarks/README.md for the command lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.common import (
    Metric,
    TimedSink,
    add_run_args,
    hardware,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    package_version,
    setup_logging,
    synchronize,
    wait_all,
    write_record,
)

NAME = "s6_parakeet"
SCENARIO = "S6 parakeet-tdt-0.6b-v3"
SAMPLE_RATE = 16000
H200_BF16_TFLOPS = 989.0  # dense bf16 peak of the H200 SXM datasheet
H200_GBS = 4800.0  # HBM3e bandwidth of the H200 SXM datasheet

# parakeet-tdt-0.6b-v3: transformers' ParakeetTDTConfig defaults are its sizes, with 128 mel bins
PARAKEET_TDT_V3: dict[str, Any] = {
    "encoder_config": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8,
                       "intermediate_size": 4096, "num_mel_bins": 128, "conv_kernel_size": 9,
                       "subsampling_conv_channels": 256, "subsampling_factor": 8},
    "vocab_size": 8193, "blank_token_id": 8192, "pad_token_id": 2, "decoder_hidden_size": 640,
    "num_decoder_layers": 2, "durations": [0, 1, 2, 3, 4], "max_symbols_per_step": 10,
}
PARAKEET_TINY: dict[str, Any] = {
    "encoder_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "intermediate_size": 128, "num_mel_bins": 128, "conv_kernel_size": 9,
                       "subsampling_conv_channels": 16, "subsampling_factor": 8},
    "vocab_size": 257, "blank_token_id": 256, "pad_token_id": 2, "decoder_hidden_size": 48,
    "num_decoder_layers": 2, "durations": [0, 1, 2, 3, 4], "max_symbols_per_step": 10,
}

log = logging.getLogger("s6")


@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    model: dict[str, Any]
    clip_s: float
    batches: tuple[int, ...]
    runs: int
    baseline_runs: int
    steps_per_iteration: int
    residual_scale: float
    blank_bias: float
    duration_bias: float
    device_loop: bool | None = None  # model_kwargs.device_loop of ours (None: the engine's default)
    cuda_graphs: bool = False  # model_kwargs.cuda_graphs of ours
    peak_tflops: float = H200_BF16_TFLOPS
    peak_gbs: float = H200_GBS
    seed: int = 0

    @property
    def max_batch(self) -> int:
        return max(self.batches)

    def describe(self) -> dict[str, Any]:
        return {
            "smoke": self.smoke, "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
            "model": self.model, "clip_s": self.clip_s, "batches": list(self.batches), "runs": self.runs,
            "baseline_runs": self.baseline_runs, "steps_per_iteration": self.steps_per_iteration,
            "residual_scale": self.residual_scale, "blank_bias": self.blank_bias,
            "duration_bias": self.duration_bias, "device_loop": self.device_loop,
            "cuda_graphs": self.cuda_graphs, "peak_tflops": self.peak_tflops,
            "peak_gbs": self.peak_gbs, "seed": self.seed, "decoding": "greedy TDT",
        }


def settings_from(args: argparse.Namespace) -> Settings:
    batches = tuple(sorted({int(b) for b in args.batches.split(",")})) if args.batches else None
    if args.smoke:
        device, dtype, model = "cpu", torch.float32, PARAKEET_TINY
        batches, clip_s = batches or (1, 4), args.clip_seconds or 10.0
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S6 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, model = "cuda", torch.bfloat16, PARAKEET_TDT_V3
        batches, clip_s = batches or (1, 32), args.clip_seconds or 30.0
    return Settings(smoke=args.smoke, device=device, dtype=dtype, model=json.loads(json.dumps(model)), clip_s=clip_s,
                    batches=batches, runs=args.runs, baseline_runs=args.baseline_runs,
                    steps_per_iteration=args.steps_per_iteration, residual_scale=args.residual_scale,
                    blank_bias=args.blank_bias, duration_bias=args.duration_bias,
                    device_loop=args.device_loop, cuda_graphs=device == "cuda" and not args.no_cuda_graphs,
                    peak_tflops=args.peak_tflops, peak_gbs=args.peak_gbs,
                    seed=args.seed)


# ------------------------------------------------------------------------------ the clips
def speech_like(seconds: float, seed: int) -> np.ndarray:
    """``seconds`` of 16 kHz mono audio shaped like speech: syllables (a 3-6 Hz on/off
    envelope) of a voiced tone with a drifting pitch and its harmonics, plus breath noise;
    deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    pitch = 110 + 60 * rng.random() + 20 * np.sin(2 * np.pi * 0.3 * t + rng.random() * 6.3)
    phase = 2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    rate = 3 + 3 * rng.random()
    envelope = np.clip(np.sin(2 * np.pi * rate * t + rng.random() * 6.3), 0, None) ** 2
    audio = 0.3 * envelope * voiced + 0.02 * rng.standard_normal(n)
    return (audio / np.abs(audio).max() * 0.5).astype(np.float32)


def clip_set(settings: Settings, count: int, offset: int) -> list[np.ndarray]:
    return [speech_like(settings.clip_s, settings.seed * 1000 + offset + i) for i in range(count)]


# ----------------------------------------------------------------------------- checkpoint
def transformers_tdt():
    """transformers' ``ParakeetForTDT`` and its config class, or a SystemExit saying which
    transformers this is and what S6 needs (the class came after 5.17)."""
    try:
        from transformers import ParakeetForTDT, ParakeetTDTConfig
    except ImportError:
        raise SystemExit(f"S6: transformers {package_version('transformers')} has no ParakeetForTDT (S6 builds its "
                         f"checkpoint and baseline with it): carry a transformers wheel that has it (5.24 was used "
                         f"to write S6) on PYTHONPATH") from None
    return ParakeetForTDT, ParakeetTDTConfig


def word_tokenizer(vocab_size: int, blank: int):
    """A word-level ``tokenizers`` model with ``vocab_size`` ids: ``w<i>`` for each text id and
    ``<blank>`` (special) at ``blank``, so every id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size) if i != blank} | {"<blank>": blank}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<blank>"])
    return tok


RESIDUAL_BRANCHES = ("feed_forward1.linear2", "feed_forward2.linear2", "self_attn.o_proj", "conv.pointwise_conv2")


@torch.no_grad()
def speech_like_weights(model: torch.nn.Module, settings: Settings) -> None:
    """Redraw ``model``'s weights so that greedy decoding behaves like a transcriber's, by a
    stated rule (parameter names are the released checkpoint's, so it applies to transformers'
    model and ours alike):

    * every matrix and convolution kernel from N(0, 1/fan_in) (activations stay near unit
      scale at any width), seeded by its name;
    * the last projection of each residual branch (both FFNs, attention, conv module) scaled by
      ``residual_scale``: at 24 random layers at full scale the encoder maps every frame to
      nearly the same vector, and a joint that sees no difference between frames blanks all
      of a clip or none of it;
    * the joint's blank logit raised by ``blank_bias`` and its duration-0 logit lowered by
      ``duration_bias`` (a random joint otherwise says a token at almost every step, and gets
      stuck emitting tokens that do not move the cursor), its other biases zero.

    Other 1-D parameters (biases, norms) keep their initial values."""
    m = settings.model
    generator = torch.Generator(device=settings.device)
    for name, param in model.named_parameters():
        if param.dim() < 2 or name.endswith(("bias_u", "bias_v")):
            continue
        std = param[0].numel() ** -0.5
        if name.rsplit(".", 1)[0].endswith(RESIDUAL_BRANCHES):
            std *= settings.residual_scale
        generator.manual_seed(settings.seed * 2**32 + zlib.crc32(name.encode()))  # by name, in any module order
        param.copy_(torch.randn(param.shape, generator=generator, device=param.device) * std)
    head = model.joint.head.bias
    head.zero_()  # not transformers' random init, which differs between its versions
    head[m["blank_token_id"]] += settings.blank_bias
    head[m["vocab_size"] + m["durations"].index(0)] -= settings.duration_bias


def parakeet_dir(path: Path, settings: Settings):
    """``ParakeetForTDT`` at ``settings.model``, seeded random init (transformers' own) on the
    device in ``settings.dtype``, saved in the released layout in ``path`` with its generation
    config, processor config and a tokenizer; returns the model (the baseline, eval mode).

    The weights are drawn by ``speech_like_weights`` (a stated rule, so that random weights
    decode about as many steps and tokens as speech would). Both sides read this one
    checkpoint, so the workload is the same for both."""
    from transformers import GenerationConfig, ParakeetFeatureExtractor

    ForTDT, TDTConfig = transformers_tdt()
    m = settings.model
    config = TDTConfig(**{**m, "encoder_config": {**m["encoder_config"], "dropout": 0.0, "layerdrop": 0.0,
                                                   "activation_dropout": 0.0, "attention_dropout": 0.0}})
    torch.manual_seed(settings.seed)
    with torch.device(settings.device):
        model = ForTDT(config)
    speech_like_weights(model, settings)
    model = model.to(settings.dtype).eval()
    model.generation_config = GenerationConfig(decoder_start_token_id=m["blank_token_id"],
                                               pad_token_id=m["pad_token_id"])
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    ParakeetFeatureExtractor(feature_size=m["encoder_config"]["num_mel_bins"]).save_pretrained(path)
    word_tokenizer(m["vocab_size"], m["blank_token_id"]).save(str(path / "tokenizer.json"))
    return model


# --------------------------------------------------------------------------- the bound
@dataclass(frozen=True)
class Roofline:
    """Parakeet TDT's cost model and the machine's limits."""

    tflops: float
    gbs: float
    encoder_bytes: int  # encoder weights (read once per batch)
    clip_flops: float  # the encoder and the joint-side projection of one clip
    batch_flops: float  # per batch, not per clip: the relative-position projections
    step_bytes: int  # the weights one greedy step reads: LSTM, projector, joint head
    step_flops: float  # one clip's greedy step
    frames: int  # encoder frames of one clip

    @classmethod
    def of(cls, m: dict[str, Any], dtype: torch.dtype, tflops: float, gbs: float, mel_frames: int) -> Roofline:
        e, size = m["encoder_config"], torch.finfo(dtype).bits // 8
        d, ffn, layers = e["hidden_size"], e["intermediate_size"], e["num_hidden_layers"]
        channels, kernel, width = e["subsampling_conv_channels"], e["conv_kernel_size"], m["decoder_hidden_size"]
        vocab_out = m["vocab_size"] + len(m["durations"])
        time_, bins, macs = mel_frames, e["num_mel_bins"], 0
        for i in range(int(math.log2(e["subsampling_factor"]))):  # 3x3 stride-2 convs: full, then depthwise + pointwise
            time_, bins = (time_ - 1) // 2 + 1, (bins - 1) // 2 + 1
            macs += time_ * bins * channels * 9 if i == 0 else time_ * bins * channels * (9 + channels)
        frames = time_
        macs += frames * channels * bins * d  # subsampling's linear
        per_frame = 2 * 2 * d * ffn + 4 * d * d + 3 * d * d + kernel * d  # two FFNs, q/k/v/o, conv module
        attention = 2 * frames * frames * d + frames * (2 * frames - 1) * d  # QK, PV, position scores
        macs += layers * (frames * per_frame + attention) + frames * d * width
        encoder_params = (channels * 9 + (channels * (9 + channels)) * (int(math.log2(e["subsampling_factor"])) - 1)
                          + channels * bins * d + layers * (2 * 2 * d * ffn + 5 * d * d + 3 * d * d + kernel * d)
                          + d * width)
        lstm = m["num_decoder_layers"] * 4 * width * 2 * width
        step_macs = lstm + width * width + width * vocab_out
        return cls(tflops=tflops, gbs=gbs, encoder_bytes=encoder_params * size, clip_flops=2.0 * macs,
                   batch_flops=2.0 * layers * (2 * frames - 1) * d * d, step_bytes=step_macs * size,
                   step_flops=2.0 * step_macs, frames=frames)

    def encoder_seconds(self, clips: int) -> float:
        return max((clips * self.clip_flops + self.batch_flops) / (self.tflops * 1e12),
                   self.encoder_bytes / (self.gbs * 1e9))

    def step_seconds(self, clips: int) -> float:
        return max(self.step_bytes / (self.gbs * 1e9), clips * self.step_flops / (self.tflops * 1e12))

    def batch_seconds(self, clips: int, steps: int) -> float:
        """Least time to transcribe ``clips`` clips whose longest needs ``steps`` greedy steps
        (one after the other: each step reads the last one's token)."""
        return self.encoder_seconds(clips) + steps * self.step_seconds(clips)


def least_steps(tokens: list[int], frames: int, max_duration: int) -> int:
    """The fewest greedy steps the batch's slowest clip can take: one per token emitted, and
    at least ``frames / max_duration`` moves of the cursor."""
    return max(max(tokens), -(-frames // max_duration))


# ------------------------------------------------------------------------------- ours
class OursRunner:
    """An in-process M* ``parakeet`` deployment of the checkpoint, driven through its runtime."""

    def __init__(self, settings: Settings, model_dir: Path):
        import mstar.model.fastconformer.model  # noqa: F401  (registers the transducer families)
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        model_kwargs: dict[str, Any] = {"steps_per_iteration": settings.steps_per_iteration, "seed": settings.seed}
        if settings.device_loop is not None:
            model_kwargs["device_loop"] = settings.device_loop
        if settings.cuda_graphs:
            model_kwargs["cuda_graphs"] = True
        self.config = parse_config({
            "model": "parakeet",
            "model_path": str(model_dir),
            "device": settings.device,
            "dtype": str(settings.dtype).removeprefix("torch."),
            "max_concurrent_requests": settings.max_batch,
            "resources": {"transducer_state": {"max_slots": settings.max_batch + 1}},
            "model_kwargs": model_kwargs,
        }, "s6 config")
        self.batches = 0
        self.deployment = start(self.config, in_process=True)

    def requests(self, clips: list[np.ndarray]) -> list:
        """Each clip's walk, built by the model's own frontend (the log-mel is computed here)."""
        return [self.deployment.spec.clip_request(torch.from_numpy(c), None) for c in clips]

    def run(self, requests: list, timeout_s: float = 900.0) -> tuple[float, list[list[int]]]:
        """Submit the clips' walks at once; the wall time until the last one ends, and each
        clip's tokens."""
        d = self.deployment
        self.batches += 1
        sinks = [_Recorder() for _ in requests]
        start = time.perf_counter()
        for i, (request, sink) in enumerate(zip(requests, sinks)):
            d.runtime.submit(f"s6-{self.batches}-{i}", request, d.spec.output_stream(request, []), sink)
        wait_all([s.timed for s in sinks], timeout_s)
        for i, sink in enumerate(sinks):
            if sink.timed.error or sink.timed.finish_reason != "stop":
                raise RuntimeError(f"clip {i} of {len(requests)}: finish {sink.timed.finish_reason!r}, "
                                   f"error {sink.timed.error!r}")
        return max(s.ended for s in sinks) - start, [s.tokens for s in sinks]

    def close(self) -> None:
        self.deployment.close()
        del self.deployment


@dataclass
class _Recorder:
    """A request's sink: its token ids and when it ended (a clip may end on a silent
    iteration, after its last token), over a ``TimedSink``."""

    timed: TimedSink = field(default_factory=TimedSink)
    tokens: list[int] = field(default_factory=list)
    ended: float = 0.0

    def __call__(self, event) -> None:
        if event is None:
            self.ended = time.perf_counter()
        elif event.token_ids:
            self.tokens.extend(event.token_ids)
        self.timed(event)


def run_ours(settings: Settings, model_dir: Path, clips: dict[int, list[np.ndarray]],
             warmup: dict[int, list[np.ndarray]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    t0 = time.perf_counter()
    runner = OursRunner(settings, model_dir)
    out["startup_s"] = time.perf_counter() - t0
    log.info("ours: deployment ready in %.1f s", out["startup_s"])
    try:
        t0 = time.perf_counter()
        for n in settings.batches:
            runner.run(runner.requests(warmup[n]))
        out["warmup_s"] = time.perf_counter() - t0
        for n in settings.batches:
            requests = runner.requests(clips[n])
            results = [runner.run(requests) for _ in range(settings.runs)]
            walls = [wall for wall, _ in results]
            tokens = results[-1][1]
            # in bf16 a clip's frames depend (to rounding) on the batch its encoder ran in, and
            # which clips share a batch depends on when each arrived: runs may differ by a few
            # tokens; how much is recorded
            drift = [agreement(r[1], tokens)["token_error_rate"] for r in results[:-1]]
            if any(drift):
                log.warning("ours: %d clip(s): runs differ from the last by token error rates %s", n, drift)
            wall = statistics.median(walls)
            out[n] = {"wall_s": walls, "rtf": n * settings.clip_s / wall, "tokens": tokens,
                      "tokens_per_clip": [len(t) for t in tokens], "run_to_run_token_error_rate": drift}
            log.info("ours: %d clip(s): %.3f s, %.1fx real time, %.0f tokens/clip", n, wall, out[n]["rtf"],
                     statistics.mean(out[n]["tokens_per_clip"]))
    finally:
        runner.close()
        del runner
        gc.collect()
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- baseline
def baseline_tokens(sequences: torch.Tensor, durations: torch.Tensor, frames: list[int], blank: int) -> tuple:
    """transformers' sequences as transcripts: the tokens emitted while the cursor (the running
    sum of ``durations``) was on the clip, and the greedy steps that took. In a batch it goes
    on decoding a finished clip on its last frame until every clip is done: those steps are
    not the clip's."""
    transcripts, steps = [], []
    for row, moves, length in zip(sequences.tolist(), durations.tolist(), frames):
        frame, tokens, taken = 0, [], 0
        for token, move in zip(row[1:], moves[1:]):
            if frame >= length:
                break
            taken += 1
            if token != blank:
                tokens.append(token)
            frame += move
        transcripts.append(tokens)
        steps.append(taken)
    return transcripts, steps


def run_baseline(settings: Settings, model, clips: dict[int, list[np.ndarray]],
                 warmup: dict[int, list[np.ndarray]], model_dir: Path) -> dict[Any, Any]:
    from transformers import ParakeetFeatureExtractor
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    device = torch.device(settings.device)
    blank = settings.model["blank_token_id"]
    extractor = ParakeetFeatureExtractor.from_pretrained(model_dir)
    out: dict[Any, Any] = {"attn_implementation": getattr(model.config, "_attn_implementation", None)}

    def features(batch: list[np.ndarray]) -> dict[str, torch.Tensor]:
        f = extractor(batch, sampling_rate=SAMPLE_RATE, return_tensors="pt", return_attention_mask=True)
        return {"input_features": f["input_features"].to(device, settings.dtype),
                "attention_mask": f["attention_mask"].to(device)}

    def generate(inputs: dict[str, torch.Tensor]) -> tuple[float, Any]:
        synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            result = model.generate(**inputs)
        synchronize(device)
        return time.perf_counter() - start, result

    t0 = time.perf_counter()
    for n in settings.batches:
        generate(features(warmup[n]))
    out["warmup_s"] = time.perf_counter() - t0
    for n in settings.batches:
        inputs = features(clips[n])
        frames = model.encoder._get_subsampling_output_length(inputs["attention_mask"].sum(-1)).tolist()
        results = [generate(inputs) for _ in range(settings.baseline_runs)]
        walls = [wall for wall, _ in results]
        tokens, steps = baseline_tokens(results[-1][1].sequences, results[-1][1].durations, frames, blank)
        wall = statistics.median(walls)
        out[n] = {"wall_s": walls, "rtf": n * settings.clip_s / wall, "tokens": tokens,
                  "tokens_per_clip": [len(t) for t in tokens], "steps_per_clip": steps,
                  "batch_steps": int(results[-1][1].sequences.shape[1] - 1), "frames": frames}
        log.info("baseline: %d clip(s): %.3f s, %.1fx real time, %.0f tokens/clip, %d steps", n, wall,
                 out[n]["rtf"], statistics.mean(out[n]["tokens_per_clip"]), out[n]["batch_steps"])
    return out


# ---------------------------------------------------------------------------- report
def edit_distance(a: list[int], b: list[int]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (x != y))
    return row[-1]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """How far ours' transcripts are from the baseline's: clips equal token for token, and the
    token error rate of ours against the baseline's (edits / the baseline's tokens)."""
    edits = [edit_distance(a, b) for a, b in zip(ours, theirs)]
    return {"clips_identical": sum(a == b for a, b in zip(ours, theirs)), "clips": len(ours),
            "token_edits": sum(edits), "baseline_tokens": sum(map(len, theirs)),
            "token_error_rate": sum(edits) / max(1, sum(map(len, theirs)))}


def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny model, CPU)" if settings.smoke else SCENARIO


def metrics_from(settings: Settings, roof: Roofline, frames: int, ours: dict | None,
                 baseline: dict | None) -> list[Metric]:
    rows = []
    max_duration = max(settings.model["durations"])
    for n in settings.batches:
        row = Metric(scenario_name(settings), f"rtf@{n}", "x real time", "higher")
        counted = ours if ours and n in ours else baseline if baseline and n in baseline else None
        if counted:
            steps = least_steps(counted[n]["tokens_per_clip"], frames, max_duration)
            row.floor = n * settings.clip_s / roof.batch_seconds(n, steps)
            row.notes.update({"floor_steps": steps, "floor_encoder_s": roof.encoder_seconds(n),
                              "floor_step_s": roof.step_seconds(n)})
        if ours and n in ours:
            row.ours = ours[n]["rtf"]
            row.notes.update({"ours_wall_s": ours[n]["wall_s"], "ours_tokens_per_clip": ours[n]["tokens_per_clip"]})
        if baseline and n in baseline:
            b = baseline[n]
            row.baseline = b["rtf"]
            row.notes.update({"baseline_wall_s": b["wall_s"], "baseline_tokens_per_clip": b["tokens_per_clip"],
                              "baseline_steps_per_clip": b["steps_per_clip"], "baseline_batch_steps": b["batch_steps"]})
        if ours and baseline and n in ours and n in baseline:
            row.notes["agreement"] = agreement(ours[n]["tokens"], baseline[n]["tokens"])
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the code paths)")
    p.add_argument("--batches", default=None, help="clips submitted at once, comma separated (default 1,32; smoke 1,4)")
    p.add_argument("--clip-seconds", type=float, default=None, help="audio per clip (default 30; smoke 10)")
    p.add_argument("--runs", type=int, default=3, help="timed batches of ours per batch size (median)")
    p.add_argument("--baseline-runs", type=int, default=3, help="timed generate calls per batch size (median)")
    p.add_argument("--steps-per-iteration", type=int, default=64,
                   help="model_kwargs.steps_per_iteration of ours: greedy steps per decode iteration")
    p.add_argument("--device-loop", default=None, type=lambda s: s.lower() in ("1", "true", "yes", "on"),
                   help="model_kwargs.device_loop of ours: true/false (default: the engine's, on for CUDA)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="ours without model_kwargs.cuda_graphs (on by default on CUDA): eager decode iterations")
    p.add_argument("--residual-scale", type=float, default=0.1,
                   help="the residual branches' last projections of the shared checkpoint, times N(0, 1/fan_in)")
    p.add_argument("--blank-bias", type=float, default=2.0, help="added to the joint's blank logit")
    p.add_argument("--duration-bias", type=float, default=2.0, help="taken from the joint's duration-0 logit")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS, help="the floor's matmul rate")
    p.add_argument("--peak-gbs", type=float, default=H200_GBS, help="the floor's memory bandwidth (GB/s)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run transformers' generate")
    p.add_argument("--skip-ours", action="store_true", help="do not run M*")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(args)
    transformers_tdt()  # say at once when this transformers cannot build the checkpoint
    device = torch.device(settings.device)
    started = time.perf_counter()
    log.info("S6 settings: %s", settings.describe())
    bandwidth = measure_memory_bandwidth(device)
    tflops = measure_matmul_tflops(device, settings.dtype)
    if settings.smoke:  # the datasheet's peaks mean nothing on the CPU: use what it measured
        settings = dataclasses.replace(settings, peak_tflops=tflops, peak_gbs=bandwidth)
    mel_frames = int(settings.clip_s * SAMPLE_RATE) // 160
    roof = Roofline.of(settings.model, settings.dtype, settings.peak_tflops, settings.peak_gbs, mel_frames)
    frames = roof.frames
    log.info("measured %.0f GB/s, %.1f TFLOP/s; floor at %.0f TFLOP/s and %.0f GB/s: %.3f TFLOP per clip, "
             "%.2f GB encoder weights", bandwidth, tflops, settings.peak_tflops, settings.peak_gbs,
             roof.clip_flops / 1e12, roof.encoder_bytes / 1e9)

    clips = {n: clip_set(settings, n, 100 * i) for i, n in enumerate(settings.batches)}
    warmup = {n: clip_set(settings, n, 10_000 + 100 * i) for i, n in enumerate(settings.batches)}
    ours = baseline = None
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="s6-parakeet-") as tmp:
        t0 = time.perf_counter()
        model = parakeet_dir(Path(tmp), settings)
        checkpoint_s = time.perf_counter() - t0
        log.info("checkpoint built and saved in %.1f s", checkpoint_s)
        if not args.skip_baseline:
            try:
                baseline = run_baseline(settings, model, clips, warmup, Path(tmp))
            except Exception as err:  # keep ours' numbers when the baseline cannot run
                log.exception("baseline failed")
                errors["baseline"] = f"{type(err).__name__}: {err}"
        del model
        gc.collect()
        if settings.device == "cuda":
            torch.cuda.empty_cache()
        if not args.skip_ours:
            try:
                ours = run_ours(settings, Path(tmp), clips, warmup)
            except Exception as err:  # keep the baseline's numbers when ours cannot run
                log.exception("ours failed")
                errors["ours"] = f"{type(err).__name__}: {err}"

    metrics = metrics_from(settings, roof, frames, ours, baseline)
    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"measured_bandwidth_gbs": bandwidth, "measured_matmul_tflops": tflops,
                     "peak_tflops": settings.peak_tflops, "peak_gbs": settings.peak_gbs,
                     "encoder_bytes": roof.encoder_bytes, "clip_flops": roof.clip_flops,
                     "batch_flops": roof.batch_flops, "step_bytes": roof.step_bytes, "step_flops": roof.step_flops,
                     "encoder_frames": frames},
        "metrics": metrics,
        "ours": _jsonable(ours),
        "baseline": _jsonable(baseline),
        "checkpoint_s": checkpoint_s,
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    for row in metrics:
        if "agreement" in row.notes:
            a = row.notes["agreement"]
            log.info("%s: %d of %d clips token-identical to transformers, token error rate %.4f", row.metric,
                     a["clips_identical"], a["clips"], a["token_error_rate"])
    log.info("S6 done in %.1f s", record["total_s"])
    return 1 if errors else 0


def _jsonable(result: dict[Any, Any] | None) -> dict[str, Any] | None:
    return None if result is None else {str(k): v for k, v in result.items()}


if __name__ == "__main__":
    sys.exit(main())
