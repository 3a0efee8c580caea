"""S15: Nemotron VoiceChat full duplex: tick time per 80 ms agent frame at 1, 16 and 32 live calls.

The released model's shapes with dummy (seeded random) weights, one GPU, an in-process
``nemotron_duplex`` deployment that speaks (text and audio: the walk ``duplex_speech``):

* the encoder: the streaming FastConformer, 24 layers of width 1024, 8 heads, FFN 4096,
  conv kernel 9, 256 subsampling channels, 128 mels, left context 70, and a linear projection
  to the LLM's width (the layer count, width and heads from a public conversion of the
  release's perception side; the FFN, kernel and subsampling widths are Canary's layout, an
  estimate). In float32 (the deployment's ``encoder_dtype`` default), or bf16 with
  ``--encoder-dtype bfloat16``.
* the nano LLM: NVIDIA-Nemotron-Nano-9B-v2 (the release's LLM: 27 Mamba-2, 4 attention and
  25 MLP layers, hidden 4480, vocab 131072), bf16, float32 SSM states.
* the talker: EarTTS from the release's ``speech_generation`` (a 28-layer Gemma-3 backbone of
  width 1152, head dim 72, the MoG head, 31 RVQ codebooks of 1024) and its causal codec
  (1764 samples of 22.05 kHz a frame), bf16.

Pools as the release sizes them: ``max_concurrent_requests`` the largest call count, calls of
``--max-session-s`` (160 s) and prompts of up to 256 tokens, pages of 128 in both KV pools.
The tokenizer is a stand-in with the LLM's 131072 ids (byte-level, no merges).

Each of N calls goes through the API a ``/generate/ws`` live call uses, in process: the
backend's ``generate`` with ``live_input``, its ``append`` into the model's ``live_stream``
(each 80 ms of audio, 1280 samples at 16 kHz, one WAV decoded by the family's
``append_item`` before the clock starts) and ``end_input``. Two pacings:

* **fast**: every append handed over at once, so the server runs as fast as it can (the
  reference's one-shot replays). ``tick_p50/p90/max@N``: the time between consecutive agent
  frames of a call (the talker's audio frames, or the text tokens with ``--text-only``), over
  every call; ``first_frame@N``: submit to a call's first agent frame; ``frames_per_s@N``.
* **realtime**: append k sent at ``start + k x 80 ms`` (all calls start together, or open
  evenly over ``--stagger-s`` seconds).
  ``lag_p50/p90/max@N``: agent frame k's arrival after append k was sent (the last frame,
  which ``end_input`` flushes, after ``end_input``); ``first_frame_live@N``;
  ``realtime_calls@N``: the calls that keep up, their lag not growing by a frame (80 ms)
  from the first quarter of the call to the last.

Target (issue 31): 32 calls within real time. The reference measured 24-25 ms per tick with
one session and 61-64 ms with 32 on one H100 (one-shot replays); those figures are in the
notes, not in the baseline column: nothing here reruns the reference.

The **floor** of a tick is the bytes one step of the three nodes must move over the measured
bandwidth (or its FLOPs over the measured matmul rate, when longer): every weight read once
(the encoder in its ``--encoder-dtype``, the nano LLM but its embedding table, the talker's backbone, its MoG
head once per unmasking iteration but the per-call gathered rows, the codec), plus per call the
Mamba-2 states read and written, the KV read (nano and talker at the run's mean length, the
encoder's cached frames). Notes keep the weights-only figure. The codec's convolutions count
as weight reads only.

``--smoke`` runs the same code with a tiny configuration, float32 on the CPU, in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.common import (
    Metric,
    add_run_args,
    hardware,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    setup_logging,
    write_record,
)
from benchmarks.live_calls import FRAME_S, PROMPT, CallTiming, live_call, summarise

NAME = "s15_nemotron_duplex"
SCENARIO = "S15 nemotron-voicechat (in process)"
KEY = "nemotron_duplex"
RATE = 16000
FRAME = 1280  # one append and one agent frame: 80 ms at 16 kHz
TARGET_CALLS = 32
REFERENCE_H100_TICK_MS = {1: [24, 25], 32: [61, 64]}  # the reference's one-shot replays, one H100
NOMINAL_GBPS = {"H200": 4800.0, "H100": 3350.0}  # HBM per card (SXM), for the record
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]

log = logging.getLogger("s15")

ENCODER = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8, "intermediate_size": 4096,
           "conv_kernel_size": 9, "subsampling_conv_channels": 256, "left_context": 70}
NANO_9B_V2 = {"vocab_size": 131072, "hidden_size": 4480, "intermediate_size": 15680, "num_attention_heads": 40,
              "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 80,
              "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128, "rms_norm_eps": 1e-5,
              "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
              "tie_word_embeddings": False, "eos_token_id": 2, "pad_token_id": 3}
SPEECH_GENERATION = {  # the release's model.speech_generation
    "model": {
        "inference_guidance_scale": 0.5, "inference_top_p_or_k": 0.8, "inference_noise_scale": 0.8,
        "codec_config": {"latent_size": 512, "n_fft": 16, "hop_length": 4, "base_hidden_size": 384,
                         "channel_mult": [1, 2, 4], "rates": [7, 7, 9], "num_blocks": 3, "kernel_size": 7,
                         "groups": 1, "codebook_size": 1024, "num_quantizers": 31, "wav_to_token_ratio": 1764},
        "tts_config": {"use_gated_fusion_for_text_audio": True, "disable_eos_prediction": True,
                       "use_audio_prompt_frozen_projection": True, "backbone_type": "gemma3_text",
                       "backbone_config": {"hidden_size": 1152, "intermediate_size": 4608, "num_hidden_layers": 28,
                                           "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 72},
                       "latent_size": 512, "codebook_size": 1024, "num_quantizers": 31, "exponent": 3.0,
                       "mog_head_config": {"intermediate_size": 4608, "num_layers": 3, "low_rank": 64,
                                           "num_predictions": 1024, "min_log_std": -4.0, "eps": 1e-6}}},
    "data": {"target_sample_rate": 22050, "frame_length": 0.08, "audio_prompt_duration": 3.0}}

# --smoke: the served tests' tiny shapes (a 0.4 s speaker prompt)
TINY_ENCODER = {"hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
                "conv_kernel_size": 9, "subsampling_conv_channels": 8, "left_context": 70}
TINY_NANO = {"vocab_size": 272, "hidden_size": 32, "hybrid_override_pattern": "M*-M-", "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "mamba_num_heads": 4,
             "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4, "chunk_size": 16,
             "eos_token_id": 2, "pad_token_id": 3}
TINY_SPEECH = {"model": {
    "inference_guidance_scale": 0.5, "inference_top_p_or_k": 0.8, "inference_noise_scale": 0.8,
    "codec_config": {"latent_size": 16, "base_hidden_size": 8, "num_blocks": 1, "codebook_size": 16,
                     "num_quantizers": 6},
    "tts_config": {"use_gated_fusion_for_text_audio": True, "disable_eos_prediction": True,
                   "use_audio_prompt_frozen_projection": True, "backbone_type": "gemma3_text",
                   "backbone_config": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
                                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                                       "sliding_window": 6,
                                       "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
                   "latent_size": 16, "codebook_size": 16, "num_quantizers": 6,
                   "mog_head_config": {"intermediate_size": 32, "num_layers": 2, "low_rank": 8,
                                       "num_predictions": 8}}},
    "data": {"target_sample_rate": 22050, "frame_length": 0.08, "audio_prompt_duration": 0.4}}


@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    calls: tuple[int, ...]
    seconds: float
    pacings: tuple[str, ...]
    speech: bool
    runs: int
    warmup_seconds: float
    max_session_s: float
    page_size: int
    attention_backend: str
    stagger_s: float = 0.0
    seed: int = 0
    encoder_dtype: str = "float32"  # model_kwargs.encoder_dtype
    cuda_graphs: bool = False  # model_kwargs.cuda_graphs

    @property
    def appends(self) -> int:
        return max(1, round(self.seconds / FRAME_S))

    def describe(self) -> dict[str, Any]:
        shapes = ("tiny test config" if self.smoke else
                  {"encoder": ENCODER, "llm": NANO_9B_V2, "speech_generation": SPEECH_GENERATION})
        return {"smoke": self.smoke, "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
                "encoder_dtype": self.encoder_dtype, "cuda_graphs": self.cuda_graphs, "key": KEY,
                "shapes": shapes, "calls": list(self.calls),
                "seconds": self.seconds, "appends_per_call": self.appends, "pacings": list(self.pacings),
                "outputs": "text,audio" if self.speech else "text", "runs": self.runs,
                "warmup_seconds": self.warmup_seconds, "max_session_s": self.max_session_s,
                "page_size": self.page_size, "attention_backend": self.attention_backend,
                "stagger_s": self.stagger_s, "seed": self.seed,
                "prompt": PROMPT, "sampling": "the deployment's (temperature 0.7, top-p 0.9)",
                "items": "each append's WAV decoded by append_item before the clock starts"}


def settings_from(args: argparse.Namespace) -> Settings:
    calls = tuple(sorted({int(c) for c in args.calls.split(",")})) if args.calls else None
    pacings = ("fast", "realtime") if args.pace == "both" else (args.pace,)
    if args.smoke:
        device, dtype, calls, seconds = "cpu", torch.float32, calls or (1, 2), args.seconds or 0.8
        max_session_s, warmup = args.max_session_s or 4.0, 0.24
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S15 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, calls, seconds = "cuda", torch.bfloat16, calls or (1, 16, 32), args.seconds or 10.0
        max_session_s, warmup = args.max_session_s or 160.0, 1.0
    if seconds + 1 > max_session_s:
        raise SystemExit(f"--seconds {seconds} must be at least 1 s under --max-session-s {max_session_s}")
    return Settings(args.smoke, device, dtype, calls, seconds, pacings, not args.text_only, args.runs, warmup,
                    max_session_s, args.page_size, args.attention_backend, args.stagger_s, args.seed,
                    encoder_dtype=args.encoder_dtype, cuda_graphs=args.cuda_graphs)


# ------------------------------------------------------------------------- checkpoint
def write_tokenizer(root: Path, vocab_size: int) -> None:
    """A byte-level tokenizer of exactly ``vocab_size`` ids: ``<unk> <s> </s> <pad>``, the 256
    byte tokens, then filler words (random ids decode to plain text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from benchmarks.common import _filler_token

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[_filler_token(len(vocab))] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(root)


def write_model_dir(root: Path, smoke: bool) -> Path:
    """The checkpoint folder without weights: ``config.json`` (encoder, llm, n_mels,
    speech_generation) and the stand-in tokenizer."""
    encoder, llm, speech = (TINY_ENCODER, TINY_NANO, TINY_SPEECH) if smoke else (ENCODER, NANO_9B_V2,
                                                                                 SPEECH_GENERATION)
    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer(root, llm["vocab_size"])
    (root / "config.json").write_text(json.dumps({"encoder": encoder, "llm": llm, "n_mels": 16 if smoke else 128,
                                                  "speech_generation": speech}))
    return root


def deployment(settings: Settings, model_dir: Path, max_prompt_tokens: int = 256) -> dict[str, Any]:
    """The deployment S15 serves (the YAML's keys): every pool holds the largest call count's
    calls of ``max_session_s``, and no more."""
    from mstar.model.eartts.engine import TalkerEngine
    from mstar.model.nemotron_duplex.config import DuplexConfig
    from mstar.model.nemotron_duplex.talker import warmup_positions

    cap, page = max(settings.calls), settings.page_size
    frames = int(settings.max_session_s * RATE) // FRAME + 2
    positions = max_prompt_tokens + frames
    max_seq_len = -(-positions // page) * page
    talker = DuplexConfig.from_dir(model_dir).talker
    talker_pages = cap * TalkerEngine.kv_pages_per_session(frames, warmup_positions(talker), page)
    return {"model": KEY, "model_path": str(model_dir), "load_format": "dummy", "device": settings.device,
            "dtype": str(settings.dtype).removeprefix("torch."), "max_seq_len": max_seq_len,
            "max_concurrent_requests": cap,
            "resources": {"kv_cache": {"max_num_pages": cap * (max_seq_len // page) + 1, "page_size": page},
                          "talker_kv": {"max_num_pages": talker_pages, "page_size": page}},
            "model_kwargs": {"seed": settings.seed, "max_session_s": settings.max_session_s,
                             "max_prompt_tokens": max_prompt_tokens,
                             "attention_backend": settings.attention_backend,
                             "encoder_dtype": settings.encoder_dtype,
                             "cuda_graphs": settings.cuda_graphs}}


# --------------------------------------------------------------------------- the bound
@dataclass(frozen=True)
class Floor:
    """One tick's bound: the three nodes' step for ``n`` calls at once."""

    bandwidth_gbs: float
    matmul_tflops: float
    weight_bytes: dict[str, int]  # per step, by node
    state_bytes_per_call: int  # Mamba-2 conv and SSM states, read and written
    nano_kv_bytes_per_position: int
    talker_kv_bytes_per_position: int  # both CFG streams
    encoder_cache_bytes_per_call: int
    gathered_bytes_per_call: int  # the MoG head's chosen components, the nano's embedding row
    flops_per_call: float

    @classmethod
    def of(cls, config, dtype: torch.dtype, bandwidth_gbs: float, matmul_tflops: float,
           encoder_dtype: torch.dtype = torch.float32) -> Floor:
        """From a ``DuplexConfig``: the modules built on the meta device and counted."""
        from mstar.model.eartts.codec import CodecDecoder
        from mstar.model.eartts.talker import Backbone, GatedFusion, MoGHead, unmask_schedule
        from mstar.model.nemotron_duplex.modeling import build_models

        cfg = config.talker.talker
        with torch.device("meta"):
            encoder, llm = build_models(config)
            backbone, head, fusion = Backbone(cfg), MoGHead(cfg), GatedFusion(cfg.hidden_size)
            codec = CodecDecoder(config.talker.codec)
        width, encoder_width = torch.finfo(dtype).bits // 8, torch.finfo(encoder_dtype).bits // 8

        def count(*modules) -> int:
            return sum(p.numel() for m in modules for p in m.parameters())

        iterations = sum(1 for k in unmask_schedule(cfg.num_quantizers, cfg.num_iter, cfg.exponent) if k)
        embed_code = cfg.latent_size * cfg.hidden_size  # read by every iteration's masked codes, and the input
        per_iteration = count(head.mlp_stack, head.proj_logits, head.proj_logs) + embed_code + (
            count(head.proj_else) if head.low_rank is not None else 0)
        rvq = cfg.num_quantizers * cfg.codebook_size * cfg.latent_size
        talker_weights = (count(backbone, fusion) + 2 * cfg.hidden_size + embed_code + iterations * per_iteration
                          + rvq)
        embed = llm.backbone.embeddings.weight.numel()
        nano_weights = count(llm) - (embed if not config.llm.tie_word_embeddings else 0)
        shapes = llm.state_shapes()
        mamba = len(config.llm.mamba_layers)
        state = mamba * (math.prod(shapes["conv"]) * width + math.prod(shapes["ssm"]) * 4)
        layers, kv_heads, head_dim = llm.cache_shape()
        enc = config.encoder
        rank = head.low_rank or cfg.latent_size
        flops = 2.0 * (count(encoder) + nano_weights + 2 * count(backbone) + 2 * iterations * per_iteration)
        return cls(bandwidth_gbs, matmul_tflops,
                   {"encoder": count(encoder) * encoder_width, "nano_llm": nano_weights * width,
                    "eartts_talker": talker_weights * width, "codec": count(codec) * width},
                   2 * state, layers * kv_heads * head_dim * 2 * width,
                   2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * width,
                   enc.num_hidden_layers * (enc.left_context or 0) * enc.hidden_size * 2 * encoder_width,
                   (iterations * rank * (cfg.hidden_size + cfg.latent_size) + config.llm.hidden_size) * width, flops)

    def tick_s(self, calls: int, nano_positions: float, talker_positions: float, weights_only: bool = False) -> float:
        """Least time of one tick of ``calls`` calls whose KV holds the given positions."""
        moved = sum(self.weight_bytes.values())
        if not weights_only:
            moved += calls * (self.state_bytes_per_call + self.encoder_cache_bytes_per_call
                              + self.gathered_bytes_per_call + self.nano_kv_bytes_per_position * nano_positions
                              + self.talker_kv_bytes_per_position * talker_positions)
        return max(moved / (self.bandwidth_gbs * 1e9), calls * self.flops_per_call / (self.matmul_tflops * 1e12))


# -------------------------------------------------------------------------------- ours
def clip(seconds_frames: int, seed: int) -> np.ndarray:
    """A call's user audio: a voiced-like tone with noise, ``seconds_frames`` appends long."""
    rng = np.random.default_rng(seed)
    t = np.arange(seconds_frames * FRAME) / RATE
    return (0.3 * np.sin(2 * np.pi * (140 + 9 * (seed % 16)) * t)
            + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


class OursRunner:
    """The in-process deployment; ``run(n, pace, appends)`` runs ``n`` live calls at once."""

    def __init__(self, settings: Settings, model_dir: Path):
        import mstar.model.nemotron_duplex.model  # noqa: F401  (registers the family)
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        self.settings = settings
        self.config = deployment(settings, model_dir)
        self.deployment = start(parse_config(self.config, "s15 nemotron_duplex config"), in_process=True)
        self.backend = self.deployment.backend
        codec = self.deployment.spec.talker_config().codec
        self.samples_per_frame, self.pad = codec.wav_to_token_ratio, codec.overlap // 2
        self.prompt_tokens = len(self.deployment.spec.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
        self.items: dict[tuple[int, int], list] = {}
        self.runs = 0

    def call_items(self, call: int, appends: int) -> list:
        """Call ``call``'s appends, each 80 ms WAV decoded by the family (as the socket does)."""
        from mstar.audio.io import encode_wav

        key = (call, appends)
        if key not in self.items:
            audio = clip(appends, call)
            self.items[key] = [self.backend.append_item(encode_wav(audio[k * FRAME:(k + 1) * FRAME], RATE),
                                                        "media[0]") for k in range(appends)]
        return self.items[key]

    def run(self, n: int, pace: str, appends: int, stagger: bool = True,
            timeout_s: float = 900.0) -> tuple[float, list[CallTiming]]:
        """The wall time (first submit to the last output) and each call's clock; raises unless
        every call ended with ``appends + 1`` agent frames (and their PCM when speaking). The
        calls open evenly over ``settings.stagger_s`` seconds (all at once without ``stagger``)."""
        self.runs += 1
        items = [self.call_items(i, appends) for i in range(n)]
        outputs = ["text", "audio"] if self.settings.speech else ["text"]
        pace_s = FRAME_S if pace == "realtime" else None

        spread = self.settings.stagger_s if stagger else 0.0

        async def one(i: int, start: float) -> CallTiming:
            await asyncio.sleep(max(0.0, start - 0.05 - time.perf_counter()))  # the call opens
            return await live_call(self.backend, f"s15-{self.runs}-{i}", items[i], pace_s, start, outputs,
                                   self.settings.seed + i, self.samples_per_frame, self.pad)

        async def together() -> list[CallTiming]:
            start = time.perf_counter() + 0.05  # call i's first append due at start + i spread / n
            calls = [one(i, start + i * spread / n) for i in range(n)]
            return await asyncio.wait_for(asyncio.gather(*calls), timeout_s)

        started = time.perf_counter()
        timings = asyncio.run(together())
        for i, t in enumerate(timings):
            frames = len(t.text)
            samples = (appends + 1) * self.samples_per_frame if self.settings.speech else 0
            if t.error or t.finish != "stop" or frames != appends + 1 or t.samples != samples:
                raise RuntimeError(f"call {i} of {n}: finish {t.finish!r}, error {t.error!r}, {frames} text tokens "
                                   f"and {t.samples} samples (expected {appends + 1} and {samples})")
        return max((t.audio or t.text)[-1] for t in timings) - started, timings

    def engines(self) -> dict[str, Any]:
        return self.deployment.runtime.workers.workers[0].engines

    def close(self) -> None:
        self.deployment.close()


@contextmanager
def node_times(runner: OursRunner, device: torch.device):
    """Each node's steps while this holds: count and wall ms per step (the device synchronized
    at each step's end, so the nodes' times add up but the run is slower than the timed ones)."""
    engines, walls = runner.engines(), {}
    for name, engine in engines.items():
        def timed(items, run=engine.run, name=name):
            t0 = time.perf_counter()
            try:
                return run(items)
            finally:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                walls.setdefault(name, []).append(time.perf_counter() - t0)
        engine.run = timed
    result: dict[str, Any] = {}
    try:
        yield result
    finally:
        for engine in engines.values():
            del engine.run
    result.update({name: {"steps": len(w), "ms_per_step": 1e3 * sum(w) / len(w)} for name, w in walls.items()})


class Stopped(Exception):
    """SIGTERM (``timeout``) arrived: the rounds not yet run are skipped, the record written."""


@contextmanager
def stop_on_sigterm():
    def stop(signum, frame):
        raise Stopped("SIGTERM")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_ours(settings: Settings, runner: OursRunner, profile: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Every pacing and call count (a call count's first round after a short warm-up round);
    a failing one is recorded under its name and the others still run; a SIGTERM keeps what
    was measured and skips the rest."""
    out: dict[str, Any] = {"fast": {}, "realtime": {}, "warmup_s": {}}
    errors: dict[str, str] = {}
    device = torch.device(settings.device)
    with stop_on_sigterm():
        for pace in settings.pacings:
            for n in settings.calls:
                try:
                    if n not in out["warmup_s"]:
                        t0 = time.perf_counter()
                        runner.run(n, "fast", max(2, round(settings.warmup_seconds / FRAME_S)), stagger=False)
                        out["warmup_s"][n] = time.perf_counter() - t0
                    runs = [runner.run(n, pace, settings.appends) for _ in range(settings.runs)]
                    got = out[pace][n] = summarise(runs, pace, settings.speech)
                    if profile and pace == "fast":
                        with node_times(runner, device) as nodes:
                            runner.run(n, "fast", settings.appends)
                        got["node_ms"] = nodes
                    log.info("%s, %d call(s): tick p50 %.1f ms (p90 %.1f, max %.1f), first frame %.0f ms, "
                             "%.1f frames/s%s", pace, n, got["tick_ms_p50"], got["tick_ms_p90"], got["tick_ms_max"],
                             got["first_frame_ms_p50"], got["frames_per_s"],
                             f", lag p50 {got['lag_ms_p50']:.0f} ms, {got['calls_kept_up']:g}/{n} kept up"
                             if pace == "realtime" else "")
                except Stopped:
                    log.warning("SIGTERM during %s@%d: writing the record of what ran", pace, n)
                    errors["stopped"] = f"SIGTERM during {pace}@{n}: it and the rounds after it did not run"
                    break
                except Exception as err:  # an out-of-memory at 32 still records 1 and 16
                    log.exception("%s@%d failed", pace, n)
                    errors[f"{pace}@{n}"] = f"{type(err).__name__}: {err}"
            if "stopped" in errors:
                break
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out, errors


# ---------------------------------------------------------------------------- report
def scenario_name(settings: Settings) -> str:
    """The rows' scenario: a bf16 encoder's rows apart from the float32 encoder's."""
    name = SCENARIO + (" (bf16 encoder)" if settings.encoder_dtype != "float32" else "")
    return f"{name} (smoke: tiny model, CPU)" if settings.smoke else name


BASELINE_NOTE = ("none rerun: the reference (NeMo's VoiceChat served by its own stack) is not installed here; its "
                 "reported figures, 24-25 ms a tick at 1 session and 61-64 ms at 32 on one H100 (one-shot "
                 "replays), are in the tick rows' notes")


def metrics_from(settings: Settings, floor: Floor, prompt_tokens: int, warmup_positions: int,
                 ours: dict[str, Any]) -> list[Metric]:
    rows: list[Metric] = []
    scenario = scenario_name(settings)
    mean_frames = (settings.appends + 1) / 2
    for n in settings.calls:
        tick = floor.tick_s(n, prompt_tokens + mean_frames, warmup_positions + mean_frames)
        notes = {"floor_ms_weights_only": 1e3 * floor.tick_s(n, 0, 0, weights_only=True), "baseline": BASELINE_NOTE}
        fast, live = ours["fast"].get(n), ours["realtime"].get(n)
        if "fast" in settings.pacings:
            got = fast or {}
            made = [Metric(scenario, f"tick_{q}@{n}", "ms", "lower", got.get(f"tick_ms_{q}"), floor=1e3 * tick)
                    for q in ("p50", "p90", "max")]
            made += [Metric(scenario, f"first_frame@{n}", "ms", "lower", got.get("first_frame_ms_p50"),
                            floor=1e3 * tick),
                     Metric(scenario, f"frames_per_s@{n}", "frames/s", "higher", got.get("frames_per_s"),
                            floor=n / tick)]
            for m in made:
                m.notes.update(notes)
                m.notes.update({f"ours_{k}": v for k, v in got.items()})
            if n in REFERENCE_H100_TICK_MS:
                made[0].notes["reference_h100_tick_ms"] = REFERENCE_H100_TICK_MS[n]
            if n == TARGET_CALLS and fast:
                made[0].notes["meets_target"] = fast["calls_within_real_time"] == n
            rows += made
        if "realtime" in settings.pacings:
            got = live or {}
            made = [Metric(scenario, f"lag_{q}@{n}", "ms", "lower", got.get(f"lag_ms_{q}"), floor=1e3 * tick)
                    for q in ("p50", "p90", "max")]
            made += [Metric(scenario, f"first_frame_live@{n}", "ms", "lower", got.get("first_frame_live_ms_p50"),
                            floor=1e3 * tick),
                     Metric(scenario, f"realtime_calls@{n}", "calls", "higher", got.get("calls_kept_up"),
                            floor=float(n))]
            for m in made:
                m.notes.update(notes)
                m.notes.update({f"ours_{k}": v for k, v in got.items()})
            if n == TARGET_CALLS and live:
                made[-1].notes["meets_target"] = live["calls_kept_up"] == n
            rows += made
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the code paths)")
    p.add_argument("--calls", default=None, help="concurrent live calls, comma separated (default 1,16,32; smoke 1,2)")
    p.add_argument("--seconds", type=float, default=None, help="user audio per call (default 10; smoke 0.8)")
    p.add_argument("--pace", choices=("both", "fast", "realtime"), default="both",
                   help="fast: every append at once (tick times); realtime: one append each 80 ms (lag)")
    p.add_argument("--text-only", action="store_true", help="output_modalities text: no talker (walk duplex)")
    p.add_argument("--runs", type=int, default=1, help="timed rounds per call count and pacing")
    p.add_argument("--stagger-s", type=float, default=0.0,
                   help="the calls of a round open evenly over this many seconds (0: all together)")
    p.add_argument("--max-session-s", type=float, default=None,
                   help="model_kwargs.max_session_s, which sizes the pools (default 160, the release's; smoke 4)")
    p.add_argument("--page-size", type=int, default=128, help="page size of both KV pools")
    p.add_argument("--attention-backend", choices=("torch", "triton"), default="torch",
                   help="model_kwargs.attention_backend (the nano LLM's)")
    p.add_argument("--encoder-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model_kwargs.encoder_dtype (the FastConformer's; its log-mels stay float32)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="model_kwargs.cuda_graphs: the three nodes' steady frame steps from CUDA graphs")
    p.add_argument("--profile", action="store_true",
                   help="after each fast round, one more with each node's steps timed (device synchronized)")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(args)
    device = torch.device(settings.device)
    started = time.perf_counter()
    log.info("S15 settings: %s", settings.describe())
    bandwidth = measure_memory_bandwidth(device)
    tflops = measure_matmul_tflops(device, settings.dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # leave the GPU to the deployment
    from mstar.model.nemotron_duplex.config import DuplexConfig
    from mstar.model.nemotron_duplex.talker import warmup_positions

    with tempfile.TemporaryDirectory(prefix="s15-nemotron-duplex-") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", settings.smoke)
        config = DuplexConfig.from_dir(model_dir)
        floor = Floor.of(config, settings.dtype, bandwidth, tflops, getattr(torch, settings.encoder_dtype))
        log.info("measured %.0f GB/s, %.1f TFLOP/s; %.2f GB of weights a tick (floor %.2f ms at one call)",
                 bandwidth, tflops, sum(floor.weight_bytes.values()) / 1e9, 1e3 * floor.tick_s(1, 0, 0, True))
        t0 = time.perf_counter()
        runner = OursRunner(settings, model_dir)
        startup_s = time.perf_counter() - t0
        log.info("ours: deployment up in %.1f s", startup_s)
        try:
            ours, errors = run_ours(settings, runner, args.profile)
        finally:
            runner.close()
    gpu = hardware()
    nominal = next((v for k, v in NOMINAL_GBPS.items() if k in str(gpu.get("gpu") or "")), None)
    record = {
        "scenario": scenario_name(settings),
        "hardware": gpu,
        "settings": settings.describe(),
        "roofline": {"memory_bandwidth_gbs": bandwidth, "nominal_bandwidth_gbs": nominal, "matmul_tflops": tflops,
                     "weight_bytes_per_tick": floor.weight_bytes,
                     "state_bytes_per_call": floor.state_bytes_per_call,
                     "nano_kv_bytes_per_position": floor.nano_kv_bytes_per_position,
                     "talker_kv_bytes_per_position": floor.talker_kv_bytes_per_position,
                     "encoder_cache_bytes_per_call": floor.encoder_cache_bytes_per_call,
                     "flops_per_call": floor.flops_per_call, "prompt_tokens": runner.prompt_tokens,
                     "codec": "weights only (its convolutions' FLOPs are not counted)"},
        "metrics": metrics_from(settings, floor, runner.prompt_tokens, warmup_positions(config.talker), ours),
        "ours": {"startup_s": startup_s, **{k: ({str(n): v for n, v in val.items()} if isinstance(val, dict) else val)
                                            for k, val in ours.items()}},
        "baseline": None,
        "baseline_missing": BASELINE_NOTE,
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S15 done in %.1f s", record["total_s"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
