"""S3: Orpheus 3B text-to-speech over HTTP: time to first audio and real-time factor.

Orpheus-3B shapes (Llama 3.2 3B: 28 layers, hidden 3072, 24 heads / 8 KV heads, FFN 8192,
vocabulary 156940, tied embeddings) with the SNAC 24 kHz decoder, random ("dummy") weights,
bf16 on one GPU (SNAC in float32), served by a real ``mstar serve`` (a subprocess with its
worker processes) and driven by N concurrent streaming ``POST /v1/audio/speech`` requests
(``response_format: pcm``, ``stream: true``).

Dummy weights would rarely say an audio token, so the deployment sets Orpheus's benchmarking
knob ``model_kwargs.benchmark_audio_only``: every token is sampled (Orpheus's default
temperature 0.6, top-p 0.8, repetition penalty 1.1) among the valid codes of its position in
the SNAC frame and END_OF_SPEECH is ignored, so each request speaks exactly
``--audio-tokens`` codes (7 per 2048-sample frame) through the real talker, stream edge, codec
and HTTP paths.

* **ours**: time to first audio byte (TTFA) per request, median; real-time factor = audio
  seconds received by all N streams / wall time from sending them to the last byte.
* **baseline**: Orpheus's reference pipeline, the way its own streaming example runs it:
  transformers ``generate`` (the N requests of a batch as one batch, sampled with the same
  parameters and restricted to the same audio codes) and the ``snac`` package decoding each
  stream's newest 28-code window every 7 codes from inside the generation loop, keeping
  the window's second frame. Eager (no torch.compile). TTFA: the first window's samples on
  the host; real-time factor: N x audio seconds over the batch's wall time.
* **floor**: the talker's bound: one decode step of N streams can be no faster than its
  weight bytes over the measured bandwidth (or N tokens' FLOPs over the matmul rate); TTFA
  adds the prefill and the codes the first SNAC window needs. SNAC's own cost is left out.

``--smoke`` runs the same code paths (server subprocess included) with a tiny model on the
CPU. See benchmarks/README.md for the command lines.
"""

from __future__ import annotations

import argparse
import asyncio
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

import torch

from benchmarks.common import (
    LLAMA_TINY,
    Metric,
    ServerProcess,
    hardware,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    tiny_llama_dir,
    write_record,
)
from benchmarks.s1_llama_decode import percentile

NAME = "s3_orpheus"
SCENARIO = "S3 orpheus-3B + SNAC (HTTP)"
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 2048
TOKENS_PER_FRAME = 7
PCM_BYTES_PER_S = SAMPLE_RATE * 2  # the s16le stream
PAGE_SIZE = 16
TEXT = "Hello! This is a benchmark of streaming speech synthesis, one sentence long."

log = logging.getLogger("s3")

ORPHEUS_3B: dict[str, Any] = {
    "vocab_size": 156940, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
    "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True,
}
ORPHEUS_TINY: dict[str, Any] = {**LLAMA_TINY, "vocab_size": 156940, "tie_word_embeddings": True}
SNAC_TINY: dict[str, Any] = {"encoder_dim": 8, "decoder_dim": 32, "codebook_size": 4096}


@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    model: dict[str, Any]
    snac: dict[str, Any]  # SnacConfig overrides ({}: snac_24khz)
    streams: tuple[int, ...]
    audio_tokens: int
    warmup_tokens: int
    runs: int
    seed: int = 0
    fast_paths: tuple[tuple[str, Any], ...] = ()  # model_kwargs: attention_backend / cuda_graphs
    codec_worker: bool = False  # SNAC in a worker process of its own (same device), not beside the talker
    pacing_ahead_s: float | None = None  # stream_pacing.ahead_s (None: no pacing)

    @property
    def audio_s(self) -> float:
        """Seconds of audio one request speaks."""
        return self.audio_tokens // TOKENS_PER_FRAME * SAMPLES_PER_FRAME / SAMPLE_RATE

    def describe(self) -> dict[str, Any]:
        return {"smoke": self.smoke, "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
                "model": self.model, "snac": self.snac or "snac_24khz", "streams": list(self.streams),
                "audio_tokens": self.audio_tokens, "audio_s_per_request": self.audio_s,
                "warmup_tokens": self.warmup_tokens, "runs": self.runs, "seed": self.seed, "text": TEXT,
                "model_kwargs": {"benchmark_audio_only": True, **dict(self.fast_paths)},
                "codec_worker": self.codec_worker, "stream_pacing_ahead_s": self.pacing_ahead_s,
                "response_format": "pcm (s16le)"}


def settings_from(args: argparse.Namespace) -> Settings:
    streams = tuple(sorted({int(s) for s in args.streams.split(",")})) if args.streams else None
    if args.smoke:
        device, dtype, model, snac = "cpu", torch.float32, dict(ORPHEUS_TINY), dict(SNAC_TINY)
        streams, tokens = streams or (1, 2), args.audio_tokens or 28
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S3 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, model, snac = "cuda", torch.bfloat16, dict(ORPHEUS_3B), {}
        streams, tokens = streams or (1, 8, 32, 64, 128), args.audio_tokens or 350
    if tokens < 4 * TOKENS_PER_FRAME or tokens % TOKENS_PER_FRAME:
        raise SystemExit(f"--audio-tokens must be a multiple of {TOKENS_PER_FRAME}, at least {4 * TOKENS_PER_FRAME}")
    fast: dict[str, Any] = {}
    if args.attention_backend:
        fast["attention_backend"] = args.attention_backend
    if args.cuda_graphs:
        fast["cuda_graphs"] = True
    if args.overlap:
        fast["overlap_scheduling"] = True
    if args.fused_kernels:
        if args.smoke:
            raise SystemExit("--fused-kernels needs the GPU")
        fast["fused_kernels"] = True
    return Settings(smoke=args.smoke, device=device, dtype=dtype, model=model, snac=snac, streams=streams,
                    audio_tokens=tokens, warmup_tokens=4 * TOKENS_PER_FRAME, runs=args.runs, seed=args.seed,
                    fast_paths=tuple(sorted(fast.items())), codec_worker=args.codec_worker,
                    pacing_ahead_s=args.pacing)


# --------------------------------------------------------------------------- the bound
@dataclass(frozen=True)
class Roofline:
    """The talker's per-step bound on the measured machine."""

    bandwidth_gbs: float
    matmul_tflops: float
    weight_bytes_read: int  # per step: every weight but the embedding rows looked up (tied head read once)
    flops_per_token: float

    @classmethod
    def of(cls, m: dict[str, Any], dtype: torch.dtype, bandwidth_gbs: float, matmul_tflops: float) -> Roofline:
        h, heads, kv = m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"]
        head_dim = m.get("head_dim") or h // heads
        per_layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * m["intermediate_size"]
        matmul = m["num_hidden_layers"] * per_layer + m["vocab_size"] * h  # + the (tied) output head
        norms = (2 * m["num_hidden_layers"] + 1) * h
        return cls(bandwidth_gbs, matmul_tflops, (matmul + norms) * (torch.finfo(dtype).bits // 8), 2.0 * matmul)

    def step_s(self, tokens: int) -> float:
        """Least time of one forward over ``tokens`` tokens (decode: one per stream)."""
        return max(self.weight_bytes_read / (self.bandwidth_gbs * 1e9),
                   tokens * self.flops_per_token / (self.matmul_tflops * 1e12))


def first_chunk_codes() -> int:
    """Codes the talker must say before Orpheus's stream edge sends its first SNAC window."""
    from mstar.model.orpheus.model import Orpheus

    [edge] = Orpheus.graph(Orpheus.__new__(Orpheus)).walks["tts"].streams
    for available in range(1, 10_000):
        if edge.policy.next_chunk(available, 0, 0, False) is not None:
            return available
    raise RuntimeError("the stream edge never sends a chunk")


# ----------------------------------------------------------------------------- server
def deployment(settings: Settings, model_dir: Path) -> dict[str, Any]:
    """The deployment S3 serves (as a YAML mapping): the talker with the run's fast paths,
    every request speaking exactly ``audio_tokens`` codes, pages for every stream at once."""
    prompt_room = 64
    pages = -(-(prompt_room + settings.audio_tokens) // PAGE_SIZE)
    kwargs: dict[str, Any] = {"benchmark_audio_only": True, "max_new_tokens": settings.audio_tokens,
                              "seed": settings.seed, **dict(settings.fast_paths)}
    if settings.snac:
        kwargs["snac_config"] = settings.snac
    config = {"model": "orpheus", "model_path": str(model_dir), "load_format": "dummy",
              "device": settings.device, "dtype": str(settings.dtype).removeprefix("torch."),
              "max_seq_len": max(2048, prompt_room + settings.audio_tokens),
              "max_concurrent_requests": max(settings.streams),
              "resources": {"kv_cache": {"max_num_pages": max(settings.streams) * pages + 8, "page_size": PAGE_SIZE}},
              "model_kwargs": kwargs}
    if settings.pacing_ahead_s is not None:
        config["stream_pacing"] = {"ahead_s": settings.pacing_ahead_s}
    if settings.codec_worker:  # rank 1 runs SNAC on the same device as rank 0's talker
        config["node_groups"] = [{"node_names": ["llm"], "ranks": [0]},
                                 {"node_names": ["snac_decoder"], "ranks": [1]}]
        if settings.device == "cuda":
            config["gpus"] = [0, 0]
    return config


class Server(ServerProcess):
    """``mstar serve orpheus --config FILE`` in a subprocess (its own process group)."""

    def __init__(self, settings: Settings, workdir: Path, model_dir: Path, startup_timeout_s: float = 600.0):
        super().__init__("orpheus", deployment(settings, model_dir), workdir, startup_timeout_s)


# ------------------------------------------------------------------------------ client
@dataclass
class StreamTiming:
    sent: float
    first_audio: float | None
    end: float
    audio_bytes: int
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes) of each body chunk

    def viable(self, bytes_per_s: float) -> bool:
        """Whether a player that starts at the first audio byte never runs dry: every later
        chunk arrives before the audio received ahead of it has played out."""
        if not self.arrivals:
            return False
        start, received = self.arrivals[0][0], 0
        for at, size in self.arrivals:
            if at - start > received / bytes_per_s:
                return False
            received += size
        return True


async def speak(client, url: str, tokens: int, seed: int) -> StreamTiming:
    """One streaming speech request; times its first audio byte and its end."""
    body = {"model": "orpheus", "input": TEXT, "voice": "tara", "response_format": "pcm", "stream": True,
            "max_tokens": tokens, "seed": seed}
    sent = time.perf_counter()
    arrivals = []
    async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"speech request failed: {response.status_code} {(await response.aread())[:500]!r}")
        async for chunk in response.aiter_raw():
            if chunk:
                arrivals.append((time.perf_counter(), len(chunk)))
    first = arrivals[0][0] if arrivals else None
    return StreamTiming(sent, first, time.perf_counter(), sum(n for _, n in arrivals), arrivals)


def run_streams(url: str, streams: int, tokens: int, seed: int) -> tuple[float, list[StreamTiming]]:
    """``streams`` requests sent at once; the wall time to the last byte and each timing."""
    import httpx

    async def go() -> tuple[float, list[StreamTiming]]:
        limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
            start = time.perf_counter()
            timings = await asyncio.gather(*[speak(client, url, tokens, seed + i) for i in range(streams)])
            return max(t.end for t in timings) - start, list(timings)

    return asyncio.run(go())


def run_ours(settings: Settings, workdir: Path, model_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    server = Server(settings, workdir, model_dir)
    out["startup_s"] = time.perf_counter() - t0
    log.info("ours: server healthy in %.1f s", out["startup_s"])
    expected = settings.audio_tokens // TOKENS_PER_FRAME * SAMPLES_PER_FRAME * 2  # s16le bytes
    try:
        t0 = time.perf_counter()
        for n in settings.streams:
            run_streams(server.url, n, settings.warmup_tokens, settings.seed)
        out["warmup_s"] = time.perf_counter() - t0
        for n in settings.streams:
            runs = [run_streams(server.url, n, settings.audio_tokens, settings.seed + 100 * r)
                    for r in range(settings.runs)]
            for _, timings in runs:
                short = [t.audio_bytes for t in timings if t.audio_bytes != expected]
                if short:
                    raise RuntimeError(f"{n} streams: audio of {short} bytes, expected {expected} each")
            ttfa = [t.first_audio - t.sent for _, timings in runs for t in timings]
            rtf = [n * settings.audio_s / wall for wall, _ in runs]
            per_stream = [settings.audio_s / (t.end - t.sent) for _, timings in runs for t in timings]
            viable = [t.viable(PCM_BYTES_PER_S) for _, timings in runs for t in timings]
            out[n] = {"ttfa_ms_median": statistics.median(ttfa) * 1e3, "ttfa_ms_max": max(ttfa) * 1e3,
                      "ttfa_ms_p90": percentile(sorted(ttfa), 0.9) * 1e3, "viable_share": sum(viable) / len(viable),
                      "rtf": statistics.median(rtf), "rtf_per_stream_median": statistics.median(per_stream),
                      "wall_s": [wall for wall, _ in runs], "audio_s_per_stream": settings.audio_s}
            log.info("ours: %d stream(s): TTFA %.0f ms (p90 %.0f), %.1fx real time, %.0f%% of streams viable", n,
                     out[n]["ttfa_ms_median"], out[n]["ttfa_ms_p90"], out[n]["rtf"], 100 * out[n]["viable_share"])
    except Exception:
        log.error("server log tail:\n%s", server.log_tail())
        raise
    finally:
        server.close()
    return out


# ---------------------------------------------------------------------------- baseline
def _talker_prompt(model_dir: Path) -> list[int]:
    """Orpheus's prompt for ``tara: TEXT`` (as ``Orpheus._speak`` builds it)."""
    from transformers import AutoTokenizer

    from mstar.model.orpheus import engine as talk

    text_ids = AutoTokenizer.from_pretrained(model_dir).encode(f"tara: {TEXT}", add_special_tokens=True)
    return [talk.START_OF_HUMAN, *text_ids, talk.END_OF_TEXT, talk.END_OF_HUMAN]


def run_baseline(settings: Settings, model_dir: Path) -> dict[str, Any]:
    """The reference pipeline (module doc) at each stream count: TTFA median and RTF."""
    from snac import SNAC
    from transformers import AutoConfig, LlamaForCausalLM, LogitsProcessor, StoppingCriteria

    from mstar.model.orpheus import engine as talk
    from mstar.model.snac import SnacConfig, codes_from_orpheus

    device = torch.device(settings.device)
    torch.manual_seed(settings.seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(AutoConfig.from_pretrained(model_dir), torch_dtype=settings.dtype)
        codec = SNAC(**SnacConfig.from_dict(settings.snac).to_dict()).eval()
    model.eval()
    prompt = _talker_prompt(model_dir)

    class AudioCodes(LogitsProcessor):
        """Each position's valid SNAC codes only (``benchmark_audio_only``, as ours)."""

        def __call__(self, input_ids, scores):
            lo, hi = talk.audio_code_range(input_ids.shape[1] - len(prompt))
            masked = torch.full_like(scores, float("-inf"))
            masked[:, lo:hi] = scores[:, lo:hi]
            return masked

    class StreamingDecoder(StoppingCriteria):
        """After every 7th code from the 28th on, decode each row's newest 28 codes and take
        the window's second frame to the host (the reference streaming decoder's rule)."""

        def __init__(self):
            self.first_audio: float | None = None

        def __call__(self, input_ids, scores, **kwargs):
            count = input_ids.shape[1] - len(prompt)
            if count >= 4 * TOKENS_PER_FRAME and count % TOKENS_PER_FRAME == 0:
                window = input_ids[:, -4 * TOKENS_PER_FRAME:] - talk.AUDIO_BASE
                window = window - (torch.arange(4 * TOKENS_PER_FRAME, device=device) % TOKENS_PER_FRAME) * talk.CODEBOOK
                levels = [torch.cat(parts) for parts in zip(*(codes_from_orpheus(row) for row in window))]
                with torch.inference_mode():
                    audio = codec.decode(levels)[:, :, SAMPLES_PER_FRAME:2 * SAMPLES_PER_FRAME].float().cpu()
                if self.first_audio is None and audio.numel():
                    self.first_audio = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def batch(n: int, tokens: int) -> tuple[float, float]:
        ids = torch.tensor([prompt] * n, device=device)
        decoder = StreamingDecoder()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.6, top_p=0.8,
                           top_k=0, repetition_penalty=1.1, max_new_tokens=tokens, min_new_tokens=tokens,
                           logits_processor=[AudioCodes()], stopping_criteria=[decoder], pad_token_id=0)
        wall = time.perf_counter() - start
        return decoder.first_audio - start, wall

    out: dict[str, Any] = {}
    for n in settings.streams:
        batch(n, settings.warmup_tokens)
        runs = [batch(n, settings.audio_tokens) for _ in range(settings.runs)]
        out[n] = {"ttfa_ms_median": statistics.median(t for t, _ in runs) * 1e3,
                  "rtf": statistics.median(n * settings.audio_s / wall for _, wall in runs),
                  "wall_s": [wall for _, wall in runs]}
        log.info("baseline: %d stream(s): TTFA %.0f ms, %.1fx real time", n, out[n]["ttfa_ms_median"], out[n]["rtf"])
    return out


# ---------------------------------------------------------------------------- report
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny model, CPU)" if settings.smoke else SCENARIO


def metrics_from(settings: Settings, roof: Roofline, prompt_tokens: int, first_codes: int,
                 ours: dict | None, baseline: dict | None = None) -> list[Metric]:
    rows = []
    scenario = scenario_name(settings)
    for n in settings.streams:
        ttfa_floor = roof.step_s(n * prompt_tokens) + (first_codes - 1) * roof.step_s(n)
        ttfa = Metric(scenario, f"ttfa@{n}", "ms", "lower", floor=ttfa_floor * 1e3)
        rtf_floor = n * SAMPLES_PER_FRAME / TOKENS_PER_FRAME / SAMPLE_RATE / roof.step_s(n)
        rtf = Metric(scenario, f"rtf@{n}", "x real time", "higher", floor=rtf_floor)
        for row in (ttfa, rtf):
            row.notes["baseline"] = "transformers generate + snac, streaming windows, eager"
        if baseline and n in baseline:
            ttfa.baseline, rtf.baseline = baseline[n]["ttfa_ms_median"], baseline[n]["rtf"]
        if ours and n in ours:
            ttfa.ours, rtf.ours = ours[n]["ttfa_ms_median"], ours[n]["rtf"]
            ttfa.notes.update({f"ours_{k}": v for k, v in ours[n].items()})
            rtf.notes.update({f"ours_{k}": v for k, v in ours[n].items()})
        rows += [ttfa, rtf]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the code paths)")
    p.add_argument("--streams", default=None,
                   help="concurrent requests, comma separated (default 1,8,32,64,128; smoke 1,2)")
    p.add_argument("--audio-tokens", type=int, default=None,
                   help="audio codes per request, a multiple of 7 (default 350 = 50 frames, 4.27 s; smoke 28)")
    p.add_argument("--runs", type=int, default=1, help="timed batches per stream count (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-backend", choices=("torch", "triton"), default=None,
                   help="the talker's model_kwargs.attention_backend (default: the engine's, torch)")
    p.add_argument("--cuda-graphs", action="store_true", help="the talker's model_kwargs.cuda_graphs (GPU)")
    p.add_argument("--fused-kernels", action="store_true", help="the talker's model_kwargs.fused_kernels (GPU)")
    p.add_argument("--overlap", action="store_true", help="the talker's model_kwargs.overlap_scheduling")
    p.add_argument("--pacing", type=float, default=None, metavar="AHEAD_S",
                   help="stream_pacing with this ahead_s: a stream this far ahead of playback sits out steps")
    p.add_argument("--skip-baseline", action="store_true", help="do not run transformers + snac")
    p.add_argument("--codec-worker", action="store_true",
                   help="SNAC on a worker process of its own (rank 1, same device), so the talker never waits for it")
    p.add_argument("--out", default=None, help="directory of the JSON record (default $OUT, else benchmarks/results)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = settings_from(args)
    device = torch.device(settings.device)
    started = time.perf_counter()
    log.info("S3 settings: %s", settings.describe())

    bandwidth = measure_memory_bandwidth(device)
    tflops = measure_matmul_tflops(device, settings.dtype)
    roof = Roofline.of(settings.model, settings.dtype, bandwidth, tflops)
    first_codes = first_chunk_codes()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # leave the GPU to the server
    log.info("measured %.0f GB/s, %.1f TFLOP/s; %.2f GB of weights per step; first audio after %d codes",
             bandwidth, tflops, roof.weight_bytes_read / 1e9, first_codes)

    with tempfile.TemporaryDirectory(prefix="s3-orpheus-") as tmp:
        model_dir = tiny_llama_dir(Path(tmp) / "model", **settings.model)
        prompt_tokens = len(_talker_prompt(model_dir))
        ours = run_ours(settings, Path(tmp), model_dir)
        baseline, errors = None, {}
        if not args.skip_baseline:
            try:
                baseline = run_baseline(settings, model_dir)
            except Exception as err:  # the record keeps ours and says why the baseline is missing
                log.exception("baseline failed")
                errors["baseline"] = f"{type(err).__name__}: {err}"

    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"memory_bandwidth_gbs": bandwidth, "matmul_tflops": tflops,
                     "weight_bytes_read_per_step": roof.weight_bytes_read, "flops_per_token": roof.flops_per_token,
                     "prompt_tokens": prompt_tokens, "first_chunk_codes": first_codes},
        "metrics": metrics_from(settings, roof, prompt_tokens, first_codes, ours, baseline),
        "ours": {str(k): v for k, v in ours.items()},
        "baseline": None if baseline is None else {str(k): v for k, v in baseline.items()},
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S3 done in %.1f s", record["total_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
