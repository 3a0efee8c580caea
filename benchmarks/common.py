"""Shared helpers of the M* benchmarks: the machine, its measured bounds, result records.

Every scenario script reports metrics as rows of one table::

    | scenario | metric | ours | baseline | ours/baseline | floor | ours/floor |

``ours/baseline`` is the plain quotient of the two values (read it with the metric's unit:
for a time, < 1 means M* is faster; for a rate, > 1 means M* is faster). ``floor`` is the
hardware bound of the metric (the least time, or the greatest rate, the machine allows) and
``ours/floor`` is the fraction of that bound M* reaches: ``floor_time / ours_time``, so it is
at most 1 for both kinds of metric and 1.0 means running at the bound.

This module imports no part of the HTTP server (the GPU machine has no FastAPI/uvicorn).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TABLE_HEADER = "| scenario | metric | ours | baseline | ours/baseline | floor | ours/floor |"
TABLE_RULE = "|---|---|---|---|---|---|---|"


# --------------------------------------------------------------------------- the machine
def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_smi(query: str) -> list[str]:
    """One ``nvidia-smi --query-gpu`` field per GPU, or ``[]`` where nvidia-smi is missing."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def hardware() -> dict[str, Any]:
    """What the numbers were measured on: GPUs, driver and CUDA, library versions, CPU."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "triton": package_version("triton"),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        driver = _nvidia_smi("driver_version")
        info.update({
            "gpu": torch.cuda.get_device_name(0),
            "gpu_count": count,
            "gpu_names": [torch.cuda.get_device_name(i) for i in range(count)],
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "gpu_sm_count": props.multi_processor_count,
            "gpu_capability": f"{props.major}.{props.minor}",
            "cuda_runtime": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "driver": driver[0] if driver else None,
        })
    else:
        info.update({"gpu": None, "gpu_count": 0})
    return info


# ------------------------------------------------------------------------ timing helpers
def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device(device: torch.device | str) -> None:
    """Drop what a finished part of a run left: garbage first, then the CUDA cache's blocks."""
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _time_op(op, device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Seconds each of ``repeats`` calls of ``op`` took (CUDA events on a GPU)."""
    for _ in range(warmup):
        op()
    synchronize(device)
    times: list[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
    return times


def time_calls(op, device: torch.device | str, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds each of ``repeats`` calls of ``op`` took after ``warmup`` untimed calls (CUDA
    events on a GPU, wall time on the CPU)."""
    return _time_op(op, torch.device(device), repeats, warmup)


def measure_memory_bandwidth(device: torch.device | str, size_bytes: int | None = None,
                             repeats: int = 10) -> float:
    """Device memory bandwidth in GB/s (1e9 bytes): the median of ``repeats`` copies of one
    large buffer into another on ``device``, counting the bytes read plus the bytes written.

    The default buffer is 2 GiB on a GPU (far beyond its L2) and 256 MiB on the CPU.
    """
    device = torch.device(device)
    if size_bytes is None:
        size_bytes = 2 * 2**30 if device.type == "cuda" else 256 * 2**20
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = statistics.median(_time_op(lambda: dst.copy_(src), device, repeats, warmup=3))
    return 2 * size_bytes / seconds / 1e9


def measure_matmul_tflops(device: torch.device | str, dtype: torch.dtype, n: int | None = None,
                          repeats: int = 10) -> float:
    """Dense matrix-product rate in TFLOP/s: the median of ``repeats`` ``n x n @ n x n``
    products of random ``dtype`` matrices on ``device`` (n = 8192 on a GPU, 1024 on the CPU)."""
    device = torch.device(device)
    if n is None:
        n = 8192 if device.type == "cuda" else 1024
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    seconds = statistics.median(_time_op(lambda: torch.mm(a, b), device, repeats, warmup=3))
    return 2 * n**3 / seconds / 1e12


@dataclass
class TimedSink:
    """A runtime sink (``Runtime.submit``'s ``sink``) that timestamps one request's events as
    the frontend gets them: every token, and every event carrying data (audio, an image, a
    video chunk): ``data_times`` and ``data_sizes``, one entry per such event."""

    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)
    first_data: float | None = None
    data_times: list[float] = field(default_factory=list)
    data_sizes: list[int] = field(default_factory=list)
    data_bytes: int = 0
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
        if event.data:
            self.first_data = self.first_data or now
            self.data_bytes += len(event.data)
            self.data_times.append(now)
            self.data_sizes.append(len(event.data))
        if event.error:
            self.error = event.error
        if event.finish_reason:
            self.finish_reason = event.finish_reason

    @property
    def last_s(self) -> float:
        """When the request's last token arrived (``perf_counter`` time)."""
        return self.token_times[-1]


def wait_all(sinks: list[TimedSink], timeout_s: float) -> None:
    """Block until every sink's request has ended; ``TimeoutError`` past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for sink in sinks:
        if not sink.done.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"{len(sinks)} requests did not finish in {timeout_s:.0f} s")


def time_speech(deployment: Any, specs: list[Any], sample_rate: int, finishes: tuple[str, ...] = ("stop",),
                timeout_s: float = 600.0) -> dict[str, Any]:
    """Submit the speech requests ``specs`` to an in-process ``deployment``'s runtime at once
    (each prepared by its model first) and time them: the wall time until the last ends, the
    seconds of float32 mono audio made, and each request's time to its first audio. A request
    that errs or ends other than ``finishes`` raises."""
    requests = [deployment.spec.prepare_speech(spec) for spec in specs]
    sinks = [TimedSink() for _ in specs]
    start = time.perf_counter()
    for spec, request, sink in zip(specs, requests, sinks):
        sink.submitted = time.perf_counter()
        deployment.runtime.submit(spec.request_id, request, deployment.spec.output_stream(request, []), sink)
    wait_all(sinks, timeout_s)
    ended = time.perf_counter()
    for i, sink in enumerate(sinks):
        if sink.error or sink.finish_reason not in finishes:
            raise RuntimeError(f"request {i}: finish {sink.finish_reason!r}, error {sink.error!r}")
    audio_s = sum(s.data_bytes for s in sinks) / 4 / sample_rate
    return {"wall_s": ended - start, "audio_s": audio_s, "ttfa_s": [s.first_data - s.submitted for s in sinks]}


def summarise_speech(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``time_speech``-style runs of one stream count: x real time at the median wall time and
    the median time to first audio over every request of every run."""
    wall = statistics.median(r["wall_s"] for r in runs)
    return {"runs": runs, "rtf": runs[0]["audio_s"] / wall,
            "ttfa_ms": 1e3 * statistics.median(t for r in runs for t in r["ttfa_s"])}


# ------------------------------------------------------------------------------ records
Better = Literal["lower", "higher"]


@dataclass
class Metric:
    """One row of the results table.

    ``better`` says which way the metric improves: ``"lower"`` for a time (ms/token),
    ``"higher"`` for a rate (tokens/s). ``floor`` is the hardware bound in the same unit.
    """

    scenario: str
    metric: str
    unit: str
    better: Better
    ours: float | None = None
    baseline: float | None = None
    floor: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def vs_baseline(self) -> float | None:
        """``ours / baseline``, the plain quotient."""
        if self.ours is None or not self.baseline:
            return None
        return self.ours / self.baseline

    @property
    def floor_fraction(self) -> float | None:
        """The fraction of the hardware bound reached: ``floor_time / ours_time`` (<= 1)."""
        if not self.ours or not self.floor:
            return None
        return self.floor / self.ours if self.better == "lower" else self.ours / self.floor

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ours/baseline"] = self.vs_baseline
        out["ours/floor"] = self.floor_fraction
        return out


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if abs(value) >= 100:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.3f}"
    return f"{value:.4f}"


def table_line(row: Metric | dict[str, Any]) -> str:
    """``| scenario | metric | ours | baseline | ours/baseline | floor | ours/floor |``."""
    if isinstance(row, Metric):
        row = row.as_dict()
    metric = f"{row['metric']} ({row['unit']})" if row.get("unit") else row["metric"]
    cells = [row["scenario"], metric, _fmt(row.get("ours")), _fmt(row.get("baseline")),
             _fmt(row.get("ours/baseline")), _fmt(row.get("floor")), _fmt(row.get("ours/floor"))]
    return "| " + " | ".join(cells) + " |"


def _json_default(value: Any) -> Any:
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, Metric):
        return value.as_dict()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def write_record(name: str, record: dict[str, Any], out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write ``record`` as JSON and print its metrics as table lines; returns the file.

    The file is ``<out_dir>/<name>-<UTC date and time>.json``; ``out_dir`` defaults to
    ``$OUT`` when that is set, else ``benchmarks/results``. ``record["metrics"]`` is a list of
    ``Metric`` (or of their ``as_dict()``); each becomes one printed table line.
    """
    now = datetime.now(UTC)
    record = {"name": name, "date": now.isoformat(timespec="seconds"), **record}
    record["metrics"] = [m.as_dict() if isinstance(m, Metric) else m for m in record.get("metrics", [])]
    directory = Path(out_dir or os.environ.get("OUT") or RESULTS_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{now.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2, default=_json_default) + "\n")
    print(TABLE_HEADER)
    print(TABLE_RULE)
    for row in record["metrics"]:
        print(table_line(row))
    print(f"wrote {path}", file=sys.stderr)
    return path


# ------------------------------------------------------------------------------- server
class ServerProcess:
    """``mstar serve MODEL --config FILE`` in a subprocess (its own process group), healthy:
    ``benchmarks.http_load.serve_config`` held open until ``close()``, for the benchmarks that
    keep a server across several phases (S2's HTTP rows, S3). ``config`` is the deployment
    mapping; the server logs at warning level into ``workdir/server.log``."""

    def __init__(self, model: str, config: dict[str, Any], workdir: Path, startup_timeout_s: float = 600.0,
                 extra_args: tuple[str, ...] = ()):
        from benchmarks.http_load import serve_config

        self._stack = ExitStack()
        self._server = self._stack.enter_context(serve_config(
            {**config, "model": model}, workdir, ("--log-level", "warning", *extra_args), startup_timeout_s))
        self.url, self.proc, self.log_path = self._server.url, self._server.proc, self._server.log_path

    def log_tail(self, chars: int = 4000) -> str:
        return self._server.log_tail(chars)

    def close(self) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left of it."""
        self._stack.close()


# --------------------------------------------------------------------- tiny checkpoints
def _filler_token(index: int) -> str:
    """A distinct byte-level token for ids past the 256 byte tokens: a space then a
    lowercase word (bijective base 26 of ``index``), so random ids decode to plain text."""
    letters = []
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters.append(chr(ord("a") + rest))
    return "\u0120" + "".join(reversed(letters))  # "Ġ" is the byte-level form of " "


LLAMA_TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "tie_word_embeddings": False,
}

LLAMA_3_1_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False,
}


def tiny_llama_dir(tmp: str | os.PathLike[str], **overrides: Any) -> Path:
    """Write a Llama ``config.json`` and a byte-level BPE tokenizer into ``tmp``; return it.

    The result is a checkpoint directory without weights: a ``llama`` deployment with
    ``load_format: dummy`` starts from it with no download, and transformers reads the same
    ``config.json``. The config is :data:`LLAMA_TINY` updated with ``overrides`` (pass
    ``**LLAMA_3_1_8B`` for the real shapes). The tokenizer has exactly ``vocab_size`` ids:
    the 256 byte tokens, filler words, then ``<|bos|>`` and ``<|eos|>`` as the last two ids
    (the config's ``bos_token_id`` / ``eos_token_id`` unless overridden).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mstar.model.llama.config import LlamaConfig

    values = {**LLAMA_TINY, **overrides}
    vocab_size = int(values["vocab_size"])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(alphabet) + 2:
        raise ValueError(f"vocab_size must be at least {len(alphabet) + 2}, got {vocab_size}")
    vocab = {token: i for i, token in enumerate(alphabet)}
    for i in range(len(alphabet), vocab_size - 2):
        vocab[_filler_token(i)] = i
    vocab["<|bos|>"], vocab["<|eos|>"] = vocab_size - 2, vocab_size - 1
    values.setdefault("bos_token_id", vocab_size - 2)
    values.setdefault("eos_token_id", vocab_size - 1)

    path = Path(tmp)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**values).to_hf_dict()
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config, indent=2))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                            pad_token="<|eos|>").save_pretrained(path)
    return path


# ------------------------------------------------------------------------- Whisper layout
WHISPER_LARGE_V3: dict[str, Any] = {
    "vocab_size": 51866,
    "num_mel_bins": 128,
    "d_model": 1280,
    "encoder_layers": 32,
    "decoder_layers": 32,
    "encoder_attention_heads": 20,
    "decoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "decoder_ffn_dim": 5120,
    "max_source_positions": 1500,
    "max_target_positions": 448,
}

WHISPER_TINY: dict[str, Any] = {
    **WHISPER_LARGE_V3,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
}


def whisper_special_tokens() -> list[str]:
    """Whisper large-v3's special tokens in id order from 50257: end of text, start of
    transcript, the 100 language tokens, the task and control tokens, then the 1501
    timestamps ``<|0.00|>`` ... ``<|30.00|>``."""
    from mstar.audio.languages import LANGUAGES

    controls = ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                "<|notimestamps|>"]
    stamps = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    return ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES), *controls, *stamps]


def whisper_dir(tmp: str | os.PathLike[str], **shape: Any) -> Path:
    """A Hugging Face Whisper directory without weights: ``config.json`` of ``shape``
    (:data:`WHISPER_LARGE_V3` by default), ``generation_config.json`` (language and task ids,
    as transformers' ``generate`` needs them) and a byte-level tokenizer laid out like
    large-v3's (50257 text ids, then the special tokens of :func:`whisper_special_tokens`).

    A ``whisper`` deployment with ``load_format: dummy`` starts from it with no download, and
    transformers reads the same files.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, WhisperConfig

    values = {**WHISPER_LARGE_V3, **shape}
    specials = whisper_special_tokens()
    text_ids = 50257
    if values["vocab_size"] != text_ids + len(specials):
        raise ValueError(f"vocab_size must be {text_ids + len(specials)} (large-v3's layout), "
                         f"got {values['vocab_size']}")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(alphabet)}
    for i in range(len(alphabet), text_ids):
        vocab[_filler_token(i)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": specials[1:]})
    ids = {token: fast.convert_tokens_to_ids(token) for token in specials}
    if ids["<|endoftext|>"] != text_ids or ids[specials[-1]] != values["vocab_size"] - 1:
        raise RuntimeError("the special tokens did not land on large-v3's ids")

    path = Path(tmp)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = WhisperConfig(**values, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
                           decoder_start_token_id=sot, begin_suppress_tokens=None, suppress_tokens=None)
    config.save_pretrained(path)
    languages = specials[2:specials.index("<|translate|>")]
    GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
        lang_to_id={t: ids[t] for t in languages}, is_multilingual=True,
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], prev_sot_token_id=ids["<|startofprev|>"],
        suppress_tokens=[], begin_suppress_tokens=[220, eot], max_length=values["max_target_positions"],
    ).save_pretrained(path)
    return path


def add_run_args(parser) -> None:
    """The options every scenario takes: ``--seed``, ``--out``, ``--verbose``."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None,
                        help="directory of the JSON record (default $OUT, else benchmarks/results)")
    parser.add_argument("--verbose", action="store_true", help="log M* at INFO level")


def setup_logging(verbose: bool) -> None:
    """INFO for the benchmark's own lines; M*'s at WARNING unless ``verbose``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger("mstar").setLevel(logging.WARNING)


def record_parts(name: str, parts: dict[str, Callable[..., list[Metric]]], args: Any, device: torch.device,
                 dtype: torch.dtype, bandwidth: float, tflops: float) -> int:
    """Run each of ``parts`` (name -> rows function) that ``args.parts`` (a comma list) names,
    one failing still recording the others (its error kept under its name), and write one
    record of their metrics; 1 if a part failed."""
    wanted = set(args.parts.split(","))
    errors: dict[str, str] = {}
    metrics: list[Metric] = []
    for part, rows in parts.items():
        if part not in wanted:
            continue
        try:
            metrics += rows(args, device, dtype, bandwidth, tflops)
        except Exception as err:
            logging.getLogger(name).exception("%s failed", part)
            errors[part] = f"{type(err).__name__}: {err}"
    record: dict[str, Any] = {"hardware": hardware(), "settings": {**vars(args), "dtype": str(dtype)},
                              "bandwidth_GBps": bandwidth, "matmul_TFLOPs": tflops, "metrics": metrics,
                              "errors": errors}
    write_record(name, record, args.out)
    return 1 if errors else 0
