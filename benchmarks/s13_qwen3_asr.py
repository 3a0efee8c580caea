"""S13: Qwen3-ASR-1.7B transcription throughput, M* against transformers' ``generate``.

Qwen3-ASR at the 1.7B release's shapes (the AuT encoder: 24 layers of width 1024 over 128
log-mels, 8 s attention windows; a dense Qwen3-1.7B decoder), bf16 on one GPU, dummy (seeded
random) weights. Each clip is 30 s of synthetic speech-like audio (voiced harmonics under a
syllable-rate envelope, and noise) and decodes exactly ``--new-tokens`` tokens greedily (the
stop tokens ignored, as S4 does: random weights would otherwise stop anywhere).

* **ours**: a ``qwen3_asr`` deployment in this process (``load_format: dummy``); each clip's
  walk is built by the model's own front end (log-mel and chat prompt, language detected) and
  submitted to the runtime, N at once (N = 1 and 32). Wall clock from submit to the last token;
  the front end's log-mel is outside it.
* **baseline**: transformers' ``Qwen3ASRForConditionalGeneration.generate`` in the same process,
  with ours' weights copied in by name (the same seeded dummy weights, built again), on the
  same clips: ``Qwen3ASRFeatureExtractor`` features and the same prompt ids, batched for N > 1,
  greedy, ``max_new_tokens`` with no end token. Where the installed transformers has no
  ``qwen3_asr`` (before 5.23) the baseline column is left empty and the record says why.

Rows per N: seconds per batch, clips/s and the real-time factor (audio seconds over wall
seconds), ours' time to first token (median over clips), each against the baseline and a floor.
The floor of one batch: the encoder's FLOPs at the measured matmul rate; the prefill, its
weights read once or its FLOPs; then per decode step the decoder's weights (the tied embedding
as the LM head) and the KV read at the measured copy bandwidth, or its FLOPs, whichever is
longer. The transcripts are compared id for id: the fraction of clips whose ids equal the
baseline's (1.0 in float32; bf16 may drift on random weights).

``--smoke`` runs the same code paths with tiny shapes in float32 on the CPU in seconds.
Expected time on one H100/H200 (defaults: 100 tokens, 3 runs): a few minutes, most of it the
baseline's 32-clip batches and two model builds; ``--runs 1``, ``--new-tokens 50`` or
``--batches 1,8`` shorten it.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
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
    free_device,
    hardware,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    setup_logging,
    synchronize,
    wait_all,
    write_record,
)

NAME = "s13_qwen3_asr"
SCENARIO = "S13 Qwen3-ASR-1.7B"
SAMPLE_RATE = 16000
PAGE_SIZE = 16

log = logging.getLogger("s13")

# Qwen/Qwen3-ASR-1.7B's shapes (released layout: everything under thinker_config)
RELEASED_AUDIO: dict[str, Any] = {
    "num_mel_bins": 128, "encoder_layers": 24, "encoder_attention_heads": 16, "encoder_ffn_dim": 4096,
    "d_model": 1024, "output_dim": 2048, "n_window": 50, "n_window_infer": 800, "downsample_hidden_size": 480}
RELEASED_TEXT: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 65536,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
RELEASED_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                    "<|audio_start|>": 151669, "<|audio_end|>": 151670, "<|audio_pad|>": 151676}
# the smoke test's shapes
TINY_AUDIO: dict[str, Any] = {
    "num_mel_bins": 16, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 32, "d_model": 16,
    "output_dim": 32, "n_window": 50, "n_window_infer": 200, "downsample_hidden_size": 8}
TINY_TEXT: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
TINY_SPECIAL = {"<|endoftext|>": 250, "<|im_start|>": 251, "<|im_end|>": 252, "<|audio_start|>": 253,
                "<|audio_end|>": 254, "<|audio_pad|>": 255}
PLAIN_WORDS = ("system", "user", "assistant", "language", "English", "<asr_text>")


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    audio: dict[str, Any]
    text: dict[str, Any]
    special: dict[str, int]
    clip_s: float
    batches: tuple[int, ...]
    new_tokens: int
    runs: int
    attention_backend: str
    fused_kernels: bool
    cuda_graphs: bool
    overlap: bool
    skip_ours: bool
    skip_baseline: bool
    seed: int

    def describe(self) -> dict[str, Any]:
        return {"smoke": self.smoke, "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
                "audio_config": self.audio, "text_config": self.text, "clip_s": self.clip_s,
                "batches": list(self.batches), "new_tokens": self.new_tokens, "runs": self.runs,
                "attention_backend": self.attention_backend, "fused_kernels": self.fused_kernels,
                "cuda_graphs": self.cuda_graphs, "overlap_scheduling": self.overlap,
                "seed": self.seed, "page_size": PAGE_SIZE, "load_format": "dummy", "language": "detected"}


def settings_from(args: argparse.Namespace) -> Settings:
    if args.smoke:
        device, dtype, audio, text, special = "cpu", torch.float32, TINY_AUDIO, TINY_TEXT, TINY_SPECIAL
        clip_s, batches, new_tokens, runs = args.clip_seconds or 3.0, (1, 4), args.new_tokens or 6, args.runs or 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S13 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, audio, text, special = "cuda", torch.bfloat16, RELEASED_AUDIO, RELEASED_TEXT, RELEASED_SPECIAL
        clip_s, batches, new_tokens, runs = args.clip_seconds or 30.0, (1, 32), args.new_tokens or 100, args.runs or 3
    if args.batches:
        batches = tuple(sorted({int(b) for b in args.batches.split(",")}))
    if new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2")
    return Settings(smoke=args.smoke, device=device, dtype=dtype, audio=dict(audio), text=dict(text),
                    special=dict(special), clip_s=clip_s, batches=batches, new_tokens=new_tokens, runs=runs,
                    attention_backend=args.attention_backend, fused_kernels=args.fused_kernels,
                    cuda_graphs=args.cuda_graphs, overlap=args.overlap,
                    skip_ours=args.skip_ours, skip_baseline=args.skip_baseline, seed=args.seed)


# ------------------------------------------------------------------------ the checkpoint
def write_model_dir(settings: Settings, directory: Path) -> Path:
    """A Qwen3-ASR directory in the released layout without weights (``load_format: dummy``):
    ``config.json`` and a word-level tokenizer with the chat markers at the release's ids."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3ASRForConditionalGeneration"], "model_type": "qwen3_asr",
              "thinker_config": {"audio_config": settings.audio, "text_config": settings.text,
                                 "audio_token_id": settings.special["<|audio_pad|>"]}}
    (directory / "config.json").write_text(json.dumps(config))
    write_tokenizer(directory, settings.text["vocab_size"], settings.special)
    return directory


def write_tokenizer(directory: Path, vocab_size: int, special: dict[str, int]) -> None:
    """One word per id (``x<i>`` for the ids nothing names) so every id the LLM writes decodes;
    the prompt's words first, the chat markers special at their ids, ``<asr_text>`` added."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = [f"x{i}" for i in range(vocab_size)]
    for i, word in enumerate(PLAIN_WORDS):
        words[i] = word
    for word, i in special.items():
        words[i] = word
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="x6"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    tok.add_tokens([AddedToken("<asr_text>", special=False)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "x6"}))


def speech_like(seconds: float, seed: int) -> np.ndarray:
    """A 16 kHz clip that looks like speech to a log-mel: a voiced source (harmonics of a pitch
    wandering around 100-220 Hz) under a 4 Hz syllable envelope with pauses, and noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    pitch = rng.uniform(100, 220) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.2, 0.6) * t))
    phase = 2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    syllables = np.clip(np.sin(2 * np.pi * rng.uniform(3, 5) * t + rng.uniform(0, 6)), 0, None) ** 2
    pauses = (np.sin(2 * np.pi * 0.3 * t + rng.uniform(0, 6)) > -0.7).astype(np.float64)
    audio = 0.2 * voiced * syllables * pauses + 0.01 * rng.standard_normal(t.shape)
    return audio.astype(np.float32)


def clips(settings: Settings, n: int) -> list[np.ndarray]:
    return [speech_like(settings.clip_s, settings.seed + 100 + i) for i in range(n)]


def prompt_ids(tokenizer, audio_rows: int, audio_token_id: int) -> list[int]:
    """The SDK's prompt (empty context, language detected) with ``audio_rows`` audio tokens."""

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    return (ids("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|audio_start|>") + [audio_token_id] * audio_rows
            + ids("<|audio_end|><|im_end|>\n<|im_start|>assistant\n"))


# ------------------------------------------------------------------------------ the floor
@dataclass(frozen=True)
class ASRRoofline:
    """The model's parts (parameter counts and per-position FLOPs) and the measured rates."""

    config: Any  # mstar.model.qwen3_asr.config.Qwen3ASRConfig
    encoder_params: int  # AuT and the projector
    decoder_params: int  # the LLM's layers and final norm
    head_params: int  # the LM head (the tied embedding read as the head)
    size: int  # bytes per weight
    bandwidth_gbs: float
    tflops: float

    @classmethod
    def build(cls, config_json: dict[str, Any], size: int, bandwidth_gbs: float, tflops: float) -> ASRRoofline:
        from mstar.model.qwen3_asr.config import Qwen3ASRConfig
        from mstar.model.qwen3_asr.modeling import Qwen3ASRModel

        config = Qwen3ASRConfig.from_hf_dict(config_json)
        with torch.device("meta"):
            model = Qwen3ASRModel(config)
        encoder = sum(p.numel() for n, p in model.named_parameters()
                      if n.startswith(("audio_tower.", "multi_modal_projector.")))
        decoder = sum(p.numel() for n, p in model.named_parameters()
                      if n.startswith("llm.") and "embed_tokens" not in n and "lm_head" not in n)
        head = config.llm.vocab_size * config.llm.hidden_size
        return cls(config, encoder, decoder, head, size, bandwidth_gbs, tflops)

    @property
    def total_params(self) -> int:
        tied = self.config.llm.tie_word_embeddings
        return self.encoder_params + self.decoder_params + self.head_params * (1 if tied else 2)

    def encoder_flops(self, mel_frames: int) -> float:
        """FLOPs of one clip through AuT and the projector (2 per multiply-add)."""
        a = self.config.audio
        full, rest = divmod(mel_frames, a.chunk_frames)
        flops = 0.0
        for frames, count in ((a.chunk_frames, full), (rest, 1 if rest else 0)):
            t, f, c_in = frames, a.num_mel_bins, 1
            for _ in range(3):  # three 3x3 stride-2 convolutions
                t, f = (t - 1) // 2 + 1, (f - 1) // 2 + 1
                flops += count * 2.0 * 9 * c_in * a.downsample_hidden_size * t * f
                c_in = a.downsample_hidden_size
            flops += count * 2.0 * a.downsample_hidden_size * a.freq_bins * a.d_model * t  # conv_out
        positions = a.positions(mel_frames)
        layer = 4 * a.d_model * a.d_model + 2 * a.d_model * a.encoder_ffn_dim
        window = min(positions, a.window_positions)
        flops += a.encoder_layers * (2.0 * layer * positions + 4.0 * positions * window * a.d_model)
        flops += 2.0 * (a.d_model * a.d_model + a.d_model * a.output_dim) * positions
        return flops

    def _kv_bytes(self, positions: int) -> float:
        t = self.config.llm
        return t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * self.size * positions

    def _attention_flops(self, queries: int, keys: int) -> float:
        t = self.config.llm
        return 4.0 * queries * keys * t.num_attention_heads * t.head_dim * t.num_hidden_layers

    def seconds(self, moved: float, flops: float) -> float:
        return max(moved / (self.bandwidth_gbs * 1e9), flops / (self.tflops * 1e12))

    def batch_s(self, clips: int, mel_frames: int, prompt_len: int, tokens: int) -> dict[str, float]:
        """The floor of ``clips`` clips transcribed together, ``tokens`` tokens each (seconds)."""
        weights = (self.decoder_params + self.head_params) * self.size
        encoder = clips * self.encoder_flops(mel_frames) / (self.tflops * 1e12)
        prefill = self.seconds(weights + self._kv_bytes(clips * prompt_len),
                               clips * (2.0 * self.decoder_params * prompt_len + 2.0 * self.head_params
                                        + self._attention_flops(prompt_len, prompt_len) / 2))
        steps = 0.0
        for k in range(1, tokens):  # the first token comes out of the prefill
            context = prompt_len + k
            steps += self.seconds(weights + self._kv_bytes(clips * context),
                                  clips * (2.0 * (self.decoder_params + self.head_params)
                                           + self._attention_flops(1, context)))
        return {"floor_s": encoder + prefill + steps, "encoder_s": encoder, "prefill_s": prefill,
                "decode_s": steps, "ttft_s": encoder + prefill}


# ------------------------------------------------------------------------------- ours
@dataclass
class IdSink(TimedSink):
    """A timed sink that keeps the token ids too."""

    ids: list[int] = field(default_factory=list)

    def __call__(self, event) -> None:
        if event is not None and event.token_ids:
            self.ids.extend(int(t) for t in event.token_ids)
        super().__call__(event)


class Ours:
    """A ``qwen3_asr`` deployment in this process; ``run(audio)`` submits the clips at once."""

    def __init__(self, settings: Settings, model_dir: Path, prompt_len: int):
        import mstar.model.qwen3_asr.model  # noqa: F401  (registers the family)
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        self.settings = settings
        max_seq = -(-(prompt_len + settings.new_tokens + 8) // PAGE_SIZE) * PAGE_SIZE
        kwargs: dict[str, Any] = {"seed": settings.seed, "max_new_tokens": settings.new_tokens,
                                  "max_audio_seconds": settings.clip_s,
                                  "attention_backend": settings.attention_backend,
                                  "fused_kernels": settings.fused_kernels, "cuda_graphs": settings.cuda_graphs,
                                  "overlap_scheduling": settings.overlap}
        config = parse_config({
            "model": "qwen3_asr", "model_path": str(model_dir), "load_format": "dummy", "device": settings.device,
            "dtype": str(settings.dtype).removeprefix("torch."), "max_concurrent_requests": max(settings.batches),
            "max_seq_len": max_seq, "resources": {"kv_cache": {
                "max_num_pages": max(settings.batches) * (max_seq // PAGE_SIZE), "page_size": PAGE_SIZE}},
            "model_kwargs": kwargs,
        }, "s13 config")
        t0 = time.perf_counter()
        self.deployment = start(config, in_process=True)
        self.startup_s = time.perf_counter() - t0
        self.calls = 0

    def request(self, audio: np.ndarray):
        """One clip's walk, built by the model's front end (language detected), decoding
        ``new_tokens`` with the stop tokens ignored."""
        request = self.deployment.spec.clip_request(torch.from_numpy(audio), "", None)
        n = self.settings.new_tokens
        request.params.update(max_new_tokens=n, max_decode_steps=n - 1, stop_token_ids=[])
        return request

    def prompt_len(self, audio: np.ndarray) -> int:
        return int(self.request(audio).inputs["prompt_ids"].numel())

    def run(self, audio: list[np.ndarray], timeout_s: float = 600.0) -> dict[str, Any]:
        d = self.deployment
        self.calls += 1
        requests = [self.request(a) for a in audio]
        sinks = [IdSink() for _ in requests]
        start = time.perf_counter()
        for i, (request, sink) in enumerate(zip(requests, sinks, strict=True)):
            sink.submitted = time.perf_counter()
            d.runtime.submit(f"s13-{self.calls}-{i}", request, d.spec.output_stream(request, []), sink)
        wait_all(sinks, timeout_s)
        for i, sink in enumerate(sinks):
            if sink.error or len(sink.ids) != self.settings.new_tokens:
                raise RuntimeError(f"clip {i} of {len(audio)}: {len(sink.ids)} of {self.settings.new_tokens} "
                                   f"tokens, finish {sink.finish_reason!r}, error {sink.error!r}")
        return {"wall_s": max(s.last_s for s in sinks) - start,
                "ttft_s": [s.token_times[0] - s.submitted for s in sinks], "ids": [s.ids for s in sinks]}

    def close(self) -> None:
        self.deployment.close()
        del self.deployment


def run_ours(settings: Settings, model_dir: Path, prompt_len: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ours = Ours(settings, model_dir, prompt_len)
    audio = clips(settings, max(settings.batches))
    out: dict[str, Any] = {"startup_s": ours.startup_s, "prompt_len": ours.prompt_len(audio[0]), "warmup_s": {}}
    try:
        for n in settings.batches:  # the first batch of a size builds its kernels (and graphs)
            w0 = time.perf_counter()
            ours.run(audio[:n])
            out["warmup_s"][n] = time.perf_counter() - w0
        for n in settings.batches:
            runs = [ours.run(audio[:n]) for _ in range(settings.runs)]
            wall = statistics.median(r["wall_s"] for r in runs)
            out[n] = {"wall_s": [r["wall_s"] for r in runs], "wall_s_median": wall,
                      "ttft_s_median": statistics.median(t for r in runs for t in r["ttft_s"]),
                      "clips_per_s": n / wall, "rtf": n * settings.clip_s / wall, "ids": runs[0]["ids"]}
            log.info("ours at %d: %.3f s per batch, %.1fx real time, first token %.0f ms", n, wall,
                     out[n]["rtf"], out[n]["ttft_s_median"] * 1e3)
    finally:
        ours.close()
        free_device(settings.device)
    out["total_s"] = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------- baseline
class BaselineUnavailable(RuntimeError):
    """The installed transformers cannot run the baseline (the column is left empty)."""


def reference_classes() -> tuple[type, type, type]:
    """transformers' ``(Qwen3ASRConfig, Qwen3ASRForConditionalGeneration,
    Qwen3ASRFeatureExtractor)``; ``BaselineUnavailable`` where this transformers has none."""
    try:
        from transformers import Qwen3ASRConfig, Qwen3ASRFeatureExtractor, Qwen3ASRForConditionalGeneration
    except ImportError as err:
        import transformers

        raise BaselineUnavailable(f"transformers {transformers.__version__} has no "
                                  f"Qwen3ASRForConditionalGeneration ({err}): no baseline column") from err
    return Qwen3ASRConfig, Qwen3ASRForConditionalGeneration, Qwen3ASRFeatureExtractor


def build_reference(settings: Settings, model_dir: Path):
    """transformers' model on the device holding ours' weights (the same seeded dummy weights,
    built again and copied in by name, every tensor both ways)."""
    from mstar.model.qwen3_asr.checkpoint import Qwen3ASRCheckpoint, our_name

    Config, Model, _ = reference_classes()  # first: an old transformers skips at once
    device = torch.device(settings.device)
    config = Config(audio_config=dict(settings.audio), text_config=dict(settings.text),
                    audio_token_id=settings.special["<|audio_pad|>"], pad_token_id=0)
    ours = Qwen3ASRCheckpoint(model_dir).load_model(device, settings.dtype, dummy=True, seed=settings.seed)
    with torch.device(device):
        model = Model(config).to(settings.dtype).eval()
    tied = ours.config.llm.tie_word_embeddings
    source = ours_tensors(ours)
    copied = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            mine = our_name(name, tied)
            if mine is None:  # the tied head: the embedding again
                continue
            if mine not in source:
                raise RuntimeError(f"the baseline's {name} has no counterpart in ours")
            param.copy_(source[mine])
            copied += param.numel()
    total = sum(p.numel() for p in ours.parameters())
    if copied != total:
        raise RuntimeError(f"{copied} of ours' {total} weights were copied into the baseline")
    del ours, source
    return model


def ours_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Ours' parameters by name, and each fused projection's segments (``q_proj`` of
    ``qkv_proj``, ``gate_proj`` of ``gate_up_proj``) as views under their unfused names."""
    from mstar.model.weights import _segments

    out = dict(model.named_parameters())
    for name, (layer, param, index) in _segments(model).items():
        start = sum(layer.local_sizes[:index])
        out[name] = param[start:start + layer.local_sizes[index]]
    return out


def reference_inputs(settings: Settings, audio: list[np.ndarray], tokenizer) -> dict[str, torch.Tensor]:
    """The clips as ``generate`` takes them: features, their mask, the prompt ids (all clips are
    the same length, so one prompt length and no padding)."""
    from transformers.models.qwen3_asr.modeling_qwen3_asr import _get_feat_extract_output_lengths

    _, _, FeatureExtractor = reference_classes()
    device = torch.device(settings.device)
    features = FeatureExtractor(feature_size=settings.audio["num_mel_bins"])(
        audio, sampling_rate=SAMPLE_RATE, return_tensors="pt", padding=True, return_attention_mask=True)
    mask = features["attention_mask"]
    rows = {int(r) for r in _get_feat_extract_output_lengths(mask.sum(-1))}
    if len(rows) != 1:
        raise RuntimeError(f"clips of different lengths: {sorted(rows)} audio rows")
    ids = torch.tensor([prompt_ids(tokenizer, rows.pop(), settings.special["<|audio_pad|>"])] * len(audio))
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "input_features": features["input_features"].to(device, settings.dtype),
            "input_features_mask": mask.to(device)}


def run_baseline(settings: Settings, model_dir: Path, tokenizer) -> dict[str, Any]:
    """``generate`` per batch size: a warm-up, then ``runs`` timed calls (median)."""
    from transformers import GenerationConfig

    device = torch.device(settings.device)
    t0 = time.perf_counter()
    model = build_reference(settings, model_dir)
    # greedy, exactly new_tokens tokens: no end token to stop at
    model.generation_config = GenerationConfig(do_sample=False, max_new_tokens=settings.new_tokens,
                                               pad_token_id=0, eos_token_id=None)
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0, "warmup_s": {},
                           "attn_implementation": model.config._attn_implementation}
    audio = clips(settings, max(settings.batches))
    try:
        with torch.inference_mode():
            for n in settings.batches:
                inputs = reference_inputs(settings, audio[:n], tokenizer)
                prompt = inputs["input_ids"].shape[1]
                w0 = time.perf_counter()
                model.generate(**inputs)
                synchronize(device)
                out["warmup_s"][n] = time.perf_counter() - w0
                times, ids = [], None
                for _ in range(settings.runs):
                    synchronize(device)
                    s0 = time.perf_counter()
                    sequences = model.generate(**inputs)
                    synchronize(device)
                    times.append(time.perf_counter() - s0)
                    if sequences.shape[1] != prompt + settings.new_tokens:
                        raise RuntimeError(f"generate made {sequences.shape[1] - prompt} of "
                                           f"{settings.new_tokens} tokens")
                    ids = ids if ids is not None else sequences[:, prompt:].tolist()
                wall = statistics.median(times)
                out[n] = {"wall_s": times, "wall_s_median": wall, "clips_per_s": n / wall,
                          "rtf": n * settings.clip_s / wall, "prompt_len": prompt, "ids": ids}
                log.info("transformers at %d: %.3f s per batch, %.1fx real time", n, wall, out[n]["rtf"])
    finally:
        del model
        free_device(settings.device)
    out["total_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------- metrics
def agreement(ours: list[list[int]] | None, theirs: list[list[int]] | None) -> dict[str, float | None]:
    """The fraction of clips whose ids equal, and the mean fraction of each clip's ids that
    agree before the first difference."""
    if not ours or not theirs:
        return {"equal_fraction": None, "prefix_fraction": None}
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(k / max(len(a), len(b), 1))
    return {"equal_fraction": sum(a == b for a, b in zip(ours, theirs)) / len(ours),
            "prefix_fraction": sum(prefixes) / len(prefixes)}


def metrics_from(settings: Settings, roof: ASRRoofline, prompt_len: int, ours: dict[Any, Any] | None,
                 baseline: dict[Any, Any] | None) -> list[Metric]:
    """Per N: ``s/batch@N``, ``clips/s@N``, ``RTF@N`` and ``TTFT@N`` (ours streams)."""
    rows: list[Metric] = []
    name = scenario_name(settings)
    frames = int(settings.clip_s * SAMPLE_RATE) // 160
    for n in settings.batches:
        floor = roof.batch_s(n, frames, prompt_len, settings.new_tokens)
        mine, theirs = (ours or {}).get(n, {}), (baseline or {}).get(n, {})
        agree = agreement(mine.get("ids"), theirs.get("ids"))
        notes = {"floor_encoder_s": floor["encoder_s"], "floor_prefill_s": floor["prefill_s"],
                 "floor_decode_s": floor["decode_s"], "prompt_tokens": prompt_len, "new_tokens": settings.new_tokens,
                 "clip_s": settings.clip_s, "transcripts_equal": agree["equal_fraction"],
                 "ids_agree_before_first_difference": agree["prefix_fraction"],
                 "ours_is": "qwen3_asr deployment in process: submit to last token (log-mel outside)",
                 "baseline_is": "transformers Qwen3ASRForConditionalGeneration.generate, greedy, batched, "
                                "on precomputed features",
                 **{f"ours_{k}": v for k, v in mine.items() if k != "ids"},
                 **{f"baseline_{k}": v for k, v in theirs.items() if k != "ids"}}
        rows.append(Metric(name, f"s/batch@{n}", "s", "lower", ours=mine.get("wall_s_median"),
                           baseline=theirs.get("wall_s_median"), floor=floor["floor_s"], notes=notes))
        rows.append(Metric(name, f"clips/s@{n}", "clip/s", "higher", ours=mine.get("clips_per_s"),
                           baseline=theirs.get("clips_per_s"), floor=n / floor["floor_s"], notes=notes))
        rows.append(Metric(name, f"RTF@{n}", "x real time", "higher", ours=mine.get("rtf"),
                           baseline=theirs.get("rtf"), floor=n * settings.clip_s / floor["floor_s"], notes=notes))
        rows.append(Metric(name, f"TTFT@{n}", "ms", "lower", ours=mine.get("ttft_s_median") and
                           mine["ttft_s_median"] * 1e3, baseline=None, floor=floor["ttft_s"] * 1e3, notes=notes))
    return rows


# ------------------------------------------------------------------------------ main
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny shapes, CPU)" if settings.smoke else SCENARIO


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the code paths)")
    p.add_argument("--batches", default=None, help="clips submitted at once (default 1,32)")
    p.add_argument("--clip-seconds", type=float, default=None, help="seconds per clip (default 30)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens decoded per clip (default 100)")
    p.add_argument("--runs", type=int, default=None, help="timed batches per size, median (default 3)")
    p.add_argument("--attention-backend", choices=("torch", "triton"), default="torch",
                   help="ours' paged attention (model_kwargs.attention_backend)")
    p.add_argument("--fused-kernels", action="store_true", help="ours with model_kwargs.fused_kernels (CUDA)")
    p.add_argument("--cuda-graphs", action="store_true", help="ours with model_kwargs.cuda_graphs (CUDA)")
    p.add_argument("--overlap", action="store_true", help="ours with model_kwargs.overlap_scheduling")
    p.add_argument("--skip-ours", action="store_true", help="do not run M*")
    p.add_argument("--skip-baseline", action="store_true", help="do not run transformers")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(args)
    started = time.perf_counter()
    log.info("S13 settings: %s", settings.describe())
    bandwidth = measure_memory_bandwidth(settings.device)
    tflops = measure_matmul_tflops(settings.device, settings.dtype)
    errors: dict[str, str] = {}
    ours: dict[Any, Any] | None = None
    baseline: dict[Any, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="s13-") as tmp:
        model_dir = write_model_dir(settings, Path(tmp) / "model")
        config_json = json.loads((model_dir / "config.json").read_text())
        roof = ASRRoofline.build(config_json, torch.finfo(settings.dtype).bits // 8, bandwidth, tflops)
        log.info("measured %.0f GB/s copy bandwidth, %.1f TFLOP/s %s matmul; %.2f B parameters", bandwidth, tflops,
                 settings.dtype, roof.total_params / 1e9)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        frames = int(settings.clip_s * SAMPLE_RATE) // 160
        prompt_len = len(prompt_ids(tokenizer, roof.config.audio.positions(frames), roof.config.audio_token_id))
        if not settings.skip_ours:
            try:
                ours = run_ours(settings, model_dir, prompt_len)
                if ours["prompt_len"] != prompt_len:
                    raise RuntimeError(f"ours' prompt has {ours['prompt_len']} ids, the baseline's {prompt_len}")
            except Exception as err:
                log.exception("ours failed")
                errors["ours"] = f"{type(err).__name__}: {err}"
        if not settings.skip_baseline:
            try:
                baseline = run_baseline(settings, model_dir, tokenizer)
            except BaselineUnavailable as err:  # an old transformers: the column stays empty
                log.warning("%s", err)
                baseline = {"unavailable": str(err)}
            except Exception as err:  # keep ours' numbers when the baseline cannot run
                log.exception("the baseline failed")
                errors["baseline"] = f"{type(err).__name__}: {err}"
    metrics = metrics_from(settings, roof, prompt_len, ours, baseline)
    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"memory_bandwidth_gbs": bandwidth, "matmul_tflops": tflops,
                     "params": {"encoder": roof.encoder_params, "decoder": roof.decoder_params,
                                "head": roof.head_params, "total": roof.total_params},
                     "encoder_tflop_per_clip": roof.encoder_flops(frames) / 1e12},
        "metrics": metrics,
        "ours": _jsonable(_without_ids(ours)),
        "baseline": _jsonable(_without_ids(baseline)),
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S13 done in %.1f s%s", record["total_s"], f"; errors: {sorted(errors)}" if errors else "")
    return 1 if errors else 0


def _without_ids(result: dict[Any, Any] | None) -> dict[Any, Any] | None:
    """The result with each batch's ids cut to the first clip's first 16 (the record stays small)."""
    if result is None:
        return None
    out = dict(result)
    for key, value in result.items():
        if isinstance(value, dict) and "ids" in value:
            out[key] = {**value, "ids": [value["ids"][0][:16]] if value["ids"] else []}
    return out


def _jsonable(value: Any) -> Any:
    """Integer keys (batch sizes) as strings, for JSON."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    sys.exit(main())
