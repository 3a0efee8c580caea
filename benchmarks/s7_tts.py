"""S7: text-to-speech without a codec LM: Kokoro-82M, 1 and N concurrent requests, against the
reference package's own inference.

Kokoro-82M shapes (its released config: PL-BERT of 12 layers of 768, the prosody predictor,
the iSTFTNet decoder), random weights, float32 on one GPU. One checkpoint serves both sides:
``kokoro.KModel`` is built at the released config with seeded random weights, written in the
released layout (``config.json``, ``kokoro-v1_0.pth``, ``voices/<name>.pt``), and our
deployment loads that directory, so both speak the same weights.

* **ours**: an in-process ``kokoro`` deployment; each request's walk is built by the model's
  own ``prepare_speech`` (``phonemes`` input: no G2P on either side) and submitted straight to
  the runtime, N at once. Its chunks are packed as the deployment does (a short first chunk),
  and the chunks of concurrent requests at the same step run as one batch.
* **baseline**: ``KModel(phonemes, voice row, speed)`` for each request, one after the other,
  as ``KPipeline`` runs it (the package synthesises one utterance at a time).

Time to first audio (TTFA, median over requests): ours, from submission to the first audio
event; the baseline's, when the request's utterance is done (its pipeline yields audio per
utterance), all N submitted at the start. Throughput: audio
seconds made per wall second (x real time). ``--smoke`` runs a tiny config on the CPU.

``--model chatterbox`` measures Chatterbox English the same way (``s7_chatterbox.py`` says how).

The package imports its G2P (misaki) at import time; where misaki is not installed (the GPU
machine) the benchmark puts empty stand-ins for it in ``sys.modules``: the model never calls it.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    Metric,
    add_run_args,
    hardware,
    package_version,
    setup_logging,
    summarise_speech,
    synchronize,
    time_speech,
    write_record,
)

NAME = "s7_tts"
SCENARIO = "S7 kokoro-82M"
NAME_CHATTERBOX = "s7_tts_chatterbox"
SCENARIO_CHATTERBOX = "S7 chatterbox"
SAMPLE_RATE = 24000
VOICE = "af_heart"
# ~300 phonemes of Kokoro's alphabet: a few sentences of English-like phoneme text
PHONEMES = ("hˈɛloʊ, ðɪs ɪz ɐ bˈɛntʃmɑːɹk ʌv spˈiːtʃ sˈɪnθəsˌaɪz. ðə kwˈɪk bɹˈaʊn fˈɑːks dʒˈʌmps "
            "ˌoʊvɚ ðə lˈeɪzi dˈɑːɡ. wˌɛn ðə sˈʌn ɹˈaɪzᵻz, ðə bˈɜːdz bᵻɡˈɪn tə sˈɪŋ, ænd ðə wˈɜːld "
            "wˈeɪks ˈʌp æɡˈɛn. wˈiː hˈoʊp ðɪs vˈɔɪs sˈaʊndz nˈætʃɚɹəl ænd klˈɪɹ tə ˈɛvɹɪwˌʌn hˌuː "
            "lˈɪsənz. ɪt ɪz ɐ lˈɔŋɡɚ pˈæsɪdʒ, sˈoʊ ðæt ðə dᵻkˈoʊdɚ hæz ɹˈiːəl wˈɜːk tə dˈuː.")
TINY_PLBERT = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
               "max_position_embeddings": 512, "num_hidden_layers": 2, "dropout": 0.1}
TINY_ISTFT = {"upsample_kernel_sizes": [4, 4], "upsample_rates": [2, 2], "gen_istft_hop_size": 2,
              "gen_istft_n_fft": 8, "resblock_dilation_sizes": [[1, 3, 5]], "resblock_kernel_sizes": [3],
              "upsample_initial_channel": 512}

log = logging.getLogger("s7")


def import_kokoro():
    """``kokoro.KModel``, with stand-ins for misaki where it is not installed."""
    try:
        import misaki.en  # noqa: F401
    except ImportError:
        package = types.ModuleType("misaki")
        package.en, package.espeak = types.ModuleType("misaki.en"), types.ModuleType("misaki.espeak")
        package.en.MToken = object  # named in the pipeline's type hints
        sys.modules.update({"misaki": package, "misaki.en": package.en, "misaki.espeak": package.espeak})
    from kokoro import KModel

    return KModel


def reference_config(smoke: bool) -> dict[str, Any]:
    """The released config.json of Kokoro-82M (from our dummy config), tiny with ``--smoke``."""
    from mstar.model.kokoro.checkpoint import dummy_config

    config = dummy_config().to_dict()
    if smoke:
        config |= {"plbert": TINY_PLBERT, "istftnet": TINY_ISTFT, "n_layer": 1}
    return config


DURATION_BIAS = -3.0
"""The duration head's bias: each of its ``max_dur`` sigmoids near 0.05, so a phoneme lasts ~2-3
predictor frames (~60 ms), speech's pace (~13 phonemes a second); random weights alone give
~25 frames a phoneme, minutes of audio for a paragraph."""


def write_checkpoint(directory: Path, config: dict[str, Any], seed: int) -> Any:
    """KModel at ``config`` with seeded random weights (moved off their init, durations at a
    speaking pace), saved in the released layout with one voice; returns the model (CPU)."""
    KModel = import_kokoro()
    directory.mkdir(parents=True, exist_ok=True)
    empty = directory / "empty.pth"
    torch.save({}, empty)  # KModel loads nothing from it: the random init stays
    torch.manual_seed(seed)
    model = KModel(repo_id="hexgrad/Kokoro-82M", config=dict(config), model=str(empty))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.02 if name.startswith("bert.") else 0.05
            p.add_(scale * torch.randn(p.shape, generator=g))
        model.predictor.duration_proj.linear_layer.bias.fill_(DURATION_BIAS)
    model.eval()
    state = {key: {"module." + k: v for k, v in getattr(model, key).state_dict().items()}
             for key in ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")}
    torch.save(state, directory / "kokoro-v1_0.pth")
    (directory / "config.json").write_text(json.dumps(config, ensure_ascii=False))
    (directory / "voices").mkdir(exist_ok=True)
    voice = torch.randn(510, 1, 256, generator=torch.Generator().manual_seed(seed + 2)) * 0.5
    torch.save(voice, directory / "voices" / f"{VOICE}.pt")
    empty.unlink()
    return model


class OursRunner:
    def __init__(self, model_dir: Path, device: str, max_batch: int, fused_kernels: bool = False):
        import mstar.model.kokoro.model  # noqa: F401  (registers the family)
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        self.config = parse_config({"model": "kokoro", "model_path": str(model_dir), "device": device,
                                    "dtype": "float32", "max_concurrent_requests": max_batch,
                                    "model_kwargs": {"fused_kernels": fused_kernels}}, "s7 config")
        self.deployment = start(self.config, in_process=True)
        self.runs = 0

    def run(self, n: int, timeout_s: float = 600.0) -> dict[str, Any]:
        from mstar.contract import SpeechSpec

        self.runs += 1
        specs = [SpeechSpec(f"s7-{self.runs}-{i}", "", VOICE, model_kwargs={"phonemes": PHONEMES})
                 for i in range(n)]
        return time_speech(self.deployment, specs, SAMPLE_RATE, timeout_s=timeout_s)

    def close(self) -> None:
        self.deployment.close()
        del self.deployment


def run_baseline(model, n: int, device: torch.device, voice: torch.Tensor) -> dict[str, Any]:
    """``n`` requests through ``KModel.__call__`` one after the other, all submitted at the
    start: request ``k``'s first audio comes when its utterance is done."""
    ref_s = voice[len(PHONEMES) - 1]
    synchronize(device)
    start = time.perf_counter()
    ttfa, audio_s = [], 0.0
    with torch.no_grad():
        for _ in range(n):
            audio = model(PHONEMES, ref_s, 1.0)
            synchronize(device)
            ttfa.append(time.perf_counter() - start)
            audio_s += audio.shape[-1] / SAMPLE_RATE
    return {"wall_s": time.perf_counter() - start, "audio_s": audio_s, "ttfa_s": ttfa}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the code paths)")
    p.add_argument("--streams", default=None, help="concurrent requests, comma separated (default 1,32; smoke 1,2)")
    p.add_argument("--runs", type=int, default=3, help="timed batches per stream count (median)")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--model", choices=("kokoro", "chatterbox"), default="kokoro")
    p.add_argument("--fused-kernels", action="store_true",
                   help="kokoro: model_kwargs.fused_kernels=true, the vocoder's AdaIN chains as Triton kernels (CUDA)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="chatterbox: T3's cap on both sides (default 300; smoke 30)")
    p.add_argument("--stream-first-chunk-tokens", type=int, default=25,
                   help="chatterbox: ours streams in growing chunks from this many tokens (0: whole utterance)")
    add_run_args(p)
    args = p.parse_args(argv)
    setup_logging(args.verbose)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    streams = [int(s) for s in (args.streams or ("1,2" if args.smoke else "1,32")).split(",")]
    if args.model == "chatterbox":
        return main_chatterbox(args, streams, device)
    config = reference_config(args.smoke)
    record: dict[str, Any] = {"scenario": SCENARIO, "hardware": hardware(),
                              "settings": {"streams": streams, "runs": args.runs, "device": str(device),
                                           "phonemes": len(PHONEMES), "smoke": args.smoke,
                                           "fused_kernels": args.fused_kernels and not args.smoke,
                                           "kokoro": package_version("kokoro")}}
    with tempfile.TemporaryDirectory(prefix="s7-") as tmp:
        model_dir = Path(tmp) / "kokoro"
        reference = write_checkpoint(model_dir, config, args.seed)
        voice = torch.load(model_dir / "voices" / f"{VOICE}.pt").to(device)
        ours: dict[int, dict[str, Any]] = {}
        runner = OursRunner(model_dir, str(device), max(streams), args.fused_kernels and not args.smoke)
        try:
            for n in streams:  # warm-up
                runner.run(n)
            for n in streams:
                ours[n] = summarise_speech([runner.run(n) for _ in range(args.runs)])
                log.info("ours: %d stream(s): %.1fx real time, TTFA median %.1f ms", n, ours[n]["rtf"],
                         ours[n]["ttfa_ms"])
        finally:
            runner.close()
            gc.collect()
        base: dict[int, dict[str, Any]] = {}
        if not args.skip_baseline:
            reference = reference.to(device)
            run_baseline(reference, 1, device, voice)  # warm-up
            for n in streams:
                base[n] = summarise_speech([run_baseline(reference, n, device, voice) for _ in range(args.runs)])
                log.info("baseline: %d stream(s): %.1fx real time, TTFA %.1f ms", n, base[n]["rtf"],
                         base[n]["ttfa_ms"])
    write_speech_record(NAME, SCENARIO, record, streams, ours, base, args.out)
    return 0


def main_chatterbox(args, streams: list[int], device: torch.device) -> int:
    from benchmarks import s7_chatterbox

    with tempfile.TemporaryDirectory(prefix="s7-") as tmp:
        ours, base, settings = s7_chatterbox.measure(args, streams, device, Path(tmp))
    record: dict[str, Any] = {"scenario": SCENARIO_CHATTERBOX, "hardware": hardware(),
                              "settings": {"streams": streams, "runs": args.runs, "device": str(device),
                                           "smoke": args.smoke, "chatterbox": package_version("chatterbox-tts"),
                                           **settings}}
    write_speech_record(NAME_CHATTERBOX, SCENARIO_CHATTERBOX, record, streams, ours, base, args.out)
    return 0


def write_speech_record(name: str, scenario: str, record: dict[str, Any], streams: list[int],
                        ours: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]], out: str | None) -> None:
    """The record of a run: x real time and time to first audio per stream count, ours against
    the baseline where it ran."""
    metrics = []
    for n in streams:
        b = base.get(n, {})
        metrics.append(Metric(scenario, f"rtf@{n}", "x real time", "higher", ours[n]["rtf"], b.get("rtf")))
        metrics.append(Metric(scenario, f"ttfa@{n}", "ms", "lower", ours[n]["ttfa_ms"], b.get("ttfa_ms")))
    record |= {"metrics": metrics, "ours": ours, "baseline": base, "errors": []}
    write_record(name, record, out)


if __name__ == "__main__":
    sys.exit(main())
