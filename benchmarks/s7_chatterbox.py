"""S7, Chatterbox mode (``s7_tts.py --model chatterbox``): Chatterbox English, 1 and N
concurrent requests, against the package's own ``ChatterboxTTS.generate``.

Shapes: the released English config (T3 = Llama-520M with a CFG pair, S3Gen's flow and HiFT,
the voice encoder), random weights, float32 on one GPU. One directory serves both sides: the
package's own classes at their default (released) sizes, seeded, written in the released layout
(``t3_cfg.safetensors``, ``s3gen.safetensors`` with the S3 tokenizer and CAMPPlus inside,
``ve.safetensors``, ``tokenizer.json``, ``conds.pt``: the package's ``prepare_conditionals``
of a synthetic 6 s clip).

* **ours**: an in-process ``chatterbox`` deployment loading that directory; requests built by
  the family's ``prepare_speech`` and submitted at once, streamed in the family's growing
  chunks from ``--stream-first-chunk-tokens`` (default 25; 0: whole utterances).
* **baseline**: ``ChatterboxTTS.from_local(dir).generate(text)`` for each request, one after
  the other (the package speaks one utterance at a time). Its ``generate`` hard-codes
  ``max_new_tokens=1000`` (a TODO in the package); random weights rarely draw the stop token,
  so both sides are capped at ``--max-new-tokens`` (the baseline's ``t3.inference`` is called
  with that cap, nothing else changed).

Both sides watermark with PerTh's shipped network (``resemble-perth``'s file).

Wheels the baseline needs beside the GPU machine's torch 2.11, transformers, diffusers,
safetensors, tokenizers, huggingface_hub and numpy (pure Python or manylinux cp312 x86_64, in
``/work/main/scratch/cbxwheel/``; install them all ``pip install --no-deps --no-index
/work/main/scratch/cbxwheel/*.whl``)::

    chatterbox-tts==0.1.7 s3tokenizer==0.3.0 conformer==0.3.2 resemble-perth==1.0.1
    torchaudio==2.11.0 librosa==0.11.0 soxr==1.1.0 soundfile==0.14.0 audioread==3.1.0
    lazy_loader==0.6 pooch==1.9.0 numba==0.68.1 llvmlite==0.50.0 scipy==1.17.1
    scikit-learn==1.9.1 threadpoolctl==3.8.0 joblib==1.6.0 msgpack==1.2.4 decorator==5.3.1
    narwhals==2.29.0 omegaconf==2.4.0 einops==0.8.2 pyloudnorm==0.2.0 onnx==1.23.2
    ml_dtypes==0.7.0 protobuf==7.36.2 setuptools==80.10.2 (perth imports pkg_resources)

Nothing is stubbed: ``chatterbox/__init__`` imports the whole package, and every module it
imports is in that list. torchaudio is used for ``Resample`` and ``compliance.kaldi.fbank``
only (building the built-in voice); if its compiled library does not load beside the
machine's torch, move ``torchaudio/lib/*.so`` aside: those two run without it. Set
``HF_HUB_OFFLINE=1`` (the multilingual tokenizer looks for a file on the Hub at import).

``--smoke`` runs the tiny models on the CPU: ours on the family's seeded tiny dummy weights;
the baseline (when ``chatterbox`` imports) on the tiny package models of
``tests/chatterbox/record_pipeline.py``, so smoke numbers compare code paths, not weights.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import summarise_speech, synchronize, time_speech

log = logging.getLogger("s7.chatterbox")

SAMPLE_RATE = 24000
TEXT = ("Hello, this is a benchmark of speech synthesis. The quick brown fox jumps over the lazy dog, "
        "and the birds begin to sing.")
SMOKE_TEXT = "Hello world. A dog, a cat!"  # within the tiny T3's 60 text positions
CLIP_SECONDS = 6.0


def package_available() -> bool:
    try:
        import chatterbox.tts  # noqa: F401
    except Exception as err:  # noqa: BLE001  (any import failure: the baseline is skipped)
        log.warning("chatterbox package not importable (%s): baseline skipped", err)
        return False
    return True


def perth_file() -> str | None:
    """PerTh's shipped network, where ``resemble-perth`` is installed."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("perth")
    except ImportError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "perth_net/pretrained/implicit/perth_net_250000.pth.tar"
    return str(path) if path.is_file() else None


def clip(path: Path) -> None:
    import soundfile

    g = np.random.default_rng(0)
    t = np.arange(int(CLIP_SECONDS * SAMPLE_RATE)) / SAMPLE_RATE
    wave = 0.3 * np.sin(2 * np.pi * (150 + 30 * np.sin(2 * np.pi * 3 * t)) * t) + 0.02 * g.standard_normal(t.size)
    soundfile.write(str(path), wave.astype(np.float32), SAMPLE_RATE)


def write_checkpoint(directory: Path, seed: int):
    """The package's ``ChatterboxTTS`` at the released sizes, seeded, saved in the released
    layout; returns it (CPU)."""
    from chatterbox.models.s3gen import S3Gen
    from chatterbox.models.t3 import T3
    from chatterbox.models.tokenizers.tokenizer import EnTokenizer
    from chatterbox.models.voice_encoder import VoiceEncoder
    from chatterbox.tts import ChatterboxTTS
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    t3, s3gen, ve = T3().eval(), S3Gen().eval(), VoiceEncoder().eval()
    for name, module in (("t3_cfg", t3), ("s3gen", s3gen), ("ve", ve)):
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(directory / f"{name}.safetensors"))
    root = Path(__file__).resolve().parents[1]
    files = json.loads((root / "tests/chatterbox/fixtures/tokenizers.json").read_text())["files"]
    (directory / "tokenizer.json").write_text(json.dumps(files["en"]))
    model = ChatterboxTTS(t3, s3gen, ve, EnTokenizer(str(directory / "tokenizer.json")), "cpu")
    clip(directory / "clip.wav")
    model.prepare_conditionals(str(directory / "clip.wav"))
    model.conds.save(directory / "conds.pt")
    return model


def tiny_package_model():
    """The tiny package ``ChatterboxTTS`` of ``tests/chatterbox/record_pipeline.py`` (smoke)."""
    import tempfile

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests" / "chatterbox"))
    import record_pipeline as rp
    from chatterbox.tts import ChatterboxTTS

    model = ChatterboxTTS.__new__(ChatterboxTTS)
    model.sr, model.t3, model.s3gen, model.ve = SAMPLE_RATE, rp.t3_model("english"), rp.s3gen_model("english"), \
        rp.voice_encoder()
    directory = Path(tempfile.mkdtemp(prefix="s7-cbx-"))
    model.tokenizer = rp.tokenizer_file("english", directory)
    model.device, model.conds = "cpu", None
    model.watermarker, _ = rp.perth_watermarker()
    rp.write_clip(directory / "clip.wav")
    model.prepare_conditionals(str(directory / "clip.wav"))
    model.conds.t3.cond_prompt_speech_tokens %= rp.START_SPEECH
    model.conds.gen["prompt_token"] %= rp.S3GEN_VOCAB["english"]
    return model


class OursRunner:
    def __init__(self, model_dir: Path | None, device: str, max_batch: int, max_new_tokens: int,
                 stream_first: int, text: str):
        import mstar.model.chatterbox.model  # noqa: F401  (registers the family)
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        kwargs: dict[str, Any] = {"max_new_tokens_limit": max_new_tokens, "stream_first_chunk_tokens": stream_first}
        config: dict[str, Any] = {"model": "chatterbox", "device": device, "dtype": "float32",
                                  "max_concurrent_requests": max_batch, "model_kwargs": kwargs}
        if model_dir is None:
            config["load_format"] = "dummy"
            kwargs["dummy_scale"] = "tiny"
        else:
            config["model_path"] = str(model_dir)
            if (perth := perth_file()) is not None:
                kwargs["perth_path"] = perth
        self.max_new_tokens, self.text = max_new_tokens, text
        self.deployment = start(parse_config(config, "s7 chatterbox config"), in_process=True)
        self.runs = 0

    def run(self, n: int, timeout_s: float = 600.0) -> dict[str, Any]:
        from mstar.contract import SpeechSpec

        self.runs += 1
        specs = [SpeechSpec(f"s7c-{self.runs}-{i}", self.text, None, 1.0,
                            {"seed": i, "max_new_tokens": self.max_new_tokens}) for i in range(n)]
        # "length": the token cap, which the baseline is held to as well
        return time_speech(self.deployment, specs, SAMPLE_RATE, ("stop", "length"), timeout_s)

    def close(self) -> None:
        self.deployment.close()
        del self.deployment


def capped(model, max_new_tokens: int) -> None:
    """The baseline's ``t3.inference`` with ``max_new_tokens`` (``generate`` hard-codes 1000)."""
    inference = model.t3.inference

    def run(*args, **kwargs):
        kwargs["max_new_tokens"] = min(kwargs.get("max_new_tokens", max_new_tokens), max_new_tokens)
        return inference(*args, **kwargs)

    model.t3.inference = run


def run_baseline(model, n: int, device: torch.device, text: str) -> dict[str, Any]:
    """``n`` requests through ``generate`` one after the other, all submitted at the start:
    request ``k``'s first audio comes when its utterance is done."""
    synchronize(device)
    start = time.perf_counter()
    ttfa, audio_s = [], 0.0
    for i in range(n):
        torch.manual_seed(i)
        wave = model.generate(text)
        synchronize(device)
        ttfa.append(time.perf_counter() - start)
        audio_s += wave.shape[-1] / SAMPLE_RATE
    return {"wall_s": time.perf_counter() - start, "audio_s": audio_s, "ttfa_s": ttfa}


def measure(args, streams: list[int], device: torch.device, tmp: Path) -> tuple[dict, dict, dict]:
    """Ours and (unless skipped or not importable) the baseline at each stream count."""
    baseline = not args.skip_baseline and package_available()
    reference, model_dir = None, None
    if baseline and not args.smoke:
        model_dir = tmp / "chatterbox"
        reference = write_checkpoint(model_dir, args.seed)
    elif baseline:
        reference = tiny_package_model()
    max_new = args.max_new_tokens or (30 if args.smoke else 300)
    text = SMOKE_TEXT if args.smoke else TEXT
    ours: dict[int, dict[str, Any]] = {}
    runner = OursRunner(model_dir, str(device), max(streams), max_new, args.stream_first_chunk_tokens, text)
    try:
        for n in streams:  # warm-up
            runner.run(n)
        for n in streams:
            ours[n] = summarise_speech([runner.run(n) for _ in range(args.runs)])
            log.info("ours: %d stream(s): %.1fx real time, TTFA median %.1f ms", n, ours[n]["rtf"], ours[n]["ttfa_ms"])
    finally:
        runner.close()
    base: dict[int, dict[str, Any]] = {}
    if reference is not None:
        if model_dir is not None:  # the package's own loader, on the directory ours served
            from chatterbox.tts import ChatterboxTTS

            reference = ChatterboxTTS.from_local(model_dir, str(device))
        else:
            reference.t3, reference.s3gen, reference.ve = (m.to(device) for m in
                                                           (reference.t3, reference.s3gen, reference.ve))
            reference.device = str(device)
        capped(reference, max_new)
        run_baseline(reference, 1, device, text)  # warm-up
        for n in streams:
            base[n] = summarise_speech([run_baseline(reference, n, device, text) for _ in range(args.runs)])
            log.info("baseline: %d stream(s): %.1fx real time, TTFA %.1f ms", n, base[n]["rtf"], base[n]["ttfa_ms"])
    settings = {"max_new_tokens": max_new, "stream_first_chunk_tokens": args.stream_first_chunk_tokens,
                "text_chars": len(text), "baseline_weights": "same directory" if model_dir else
                ("tiny package models (smoke)" if reference is not None else None)}
    return ours, base, settings
