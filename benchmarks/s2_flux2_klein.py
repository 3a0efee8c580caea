"""S2: FLUX.2 [klein] 4B: seconds per DiT step and per 1024x1024 image, against diffusers.

FLUX.2-klein-4B shapes (DiT: 5 double-stream + 20 single-stream blocks, 24 heads of 128,
text width 3 x 2560; Qwen3-4B text encoder run to layer 27; the FLUX.2 VAE), random ("dummy")
weights, bf16 on one GPU, 1024x1024 images (64 x 64 = 4096 latent tokens beside 512 text
tokens), 4 steps, batch 1 and 4.

* **DiT step**: one forward of the transformer on random latents and text features.
  ``ours`` is ``mstar.model.flux2.Flux2Transformer`` eager and compiled; ``baseline`` is
  diffusers' ``Flux2Transformer2DModel`` with the same weights (copied from ours), eager and
  compiled the same way (``--compile-mode regional``: every block compiled, as diffusers'
  ``compile_repeated_blocks`` does; ``full``: ``torch.compile`` of the whole model). Their
  outputs are compared, as a check that both compute the same function.
* **image**: a whole text-to-image request (text encoder, 4-step denoise Loop, VAE decode,
  PNG) through an in-process M* deployment of ``flux2_klein``; seconds per image with one
  request, and with 4 submitted at once (wall time / 4). The fast paths:
  ``--runtime-compile`` (DiT and VAE decode compiled), ``--attention-backend cudnn``,
  ``--cuda-graphs`` (the text encoder replayed from a CUDA graph), ``--fused-kernels`` (our
  QK-norm + RoPE kernel, also in the compiled DiT steps). ``--http`` also times the same
  requests through a real ``mstar serve`` process (``POST /v1/images/generations``, one
  image per request, N requests at once), in rows of their own.
  Baseline: diffusers' ``Flux2KleinPipeline`` (Qwen3 text encoder, the same DiT, the FLUX.2
  VAE, flow-match Euler) with the same configs and random weights, its transformer blocks and
  VAE decoder compiled (unless ``--no-compile``), called with the prompt N times as one batch;
  it returns PIL images, so its time has no PNG encoding (ours' has; the notes hold what
  encoding one of its images with PIL took).
* **floor**: DiT FLOPs per step (matmuls and attention, counted from the shapes) over the
  measured bf16 matmul rate; per image, the steps' floor plus the text encoder's and the VAE
  decoder's FLOPs (counted by torch's FLOP counter on the meta device) over the same rate.

``--smoke`` runs the same code paths with a tiny model on the CPU in seconds.
See benchmarks/README.md for the command lines.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    Metric,
    ServerProcess,
    add_run_args,
    hardware,
    measure_matmul_tflops,
    setup_logging,
    synchronize,
    time_calls,
    write_record,
)

NAME = "s2_flux2_klein"
SCENARIO = "S2 flux2-klein-4B"
TEXT_TOKENS = 512  # the klein pipeline pads every prompt to 512 tokens
PROMPT = "a lighthouse on a cliff at dusk, waves breaking on the rocks below"

log = logging.getLogger("s2")

# Transformer: diffusers' FLUX.2 conversion script's "klein-4b" config (also the checkpoint's
# transformer/config.json as third-party loaders quote it); mstar's preset holds the same.
KLEIN_4B_DIT: dict[str, Any] = {
    "patch_size": 1, "in_channels": 128, "out_channels": None, "num_layers": 5, "num_single_layers": 20,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000,
    "eps": 1e-6, "guidance_embeds": False,
}
# Text encoder: Qwen3-4B's config.json (the pipeline reads hidden states 9, 18 and 27 of its 36 layers).
QWEN3_4B: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True,
}
FLUX2_VAE: dict[str, Any] = {}  # AutoencoderKLFlux2's defaults are the FLUX.2 VAE

TINY_DIT: dict[str, Any] = {**KLEIN_4B_DIT, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
                            "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 48,
                            "timestep_guidance_channels": 32, "axes_dims_rope": [4, 4, 4, 4]}
TINY_QWEN3: dict[str, Any] = {**QWEN3_4B, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 28,
                              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                              "max_position_embeddings": 1024}
TINY_VAE: dict[str, Any] = {"block_out_channels": [8, 16], "layers_per_block": 1, "latent_channels": 4,
                            "norm_num_groups": 4}

QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    dit: dict[str, Any]
    text: dict[str, Any]
    vae: dict[str, Any]
    height: int
    width: int
    steps: int
    batches: tuple[int, ...]
    step_runs: int
    image_runs: int
    compile: bool
    compile_mode: str
    compile_backend: str
    runtime_compile: bool
    seed: int = 0
    attention_backend: str = "sdpa"  # ours' model_kwargs.attention_backend (the baseline keeps PyTorch's choice)
    cuda_graphs: bool = False  # model_kwargs.cuda_graphs for the image runs (the text encoder replayed from a graph)
    fused_kernels: bool = False  # ours' QK-norm + RoPE kernel: compiled DiT steps and model_kwargs.fused_kernels
    http: bool = False  # also time whole images through an `mstar serve` process

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        out["batches"] = list(self.batches)
        out["text_tokens"] = TEXT_TOKENS
        return out


def settings_from(args: argparse.Namespace) -> Settings:
    batches = tuple(sorted({int(b) for b in args.batches.split(",")})) if args.batches else (1, 4)
    if args.smoke:
        device, dtype, dit, text, vae = "cpu", torch.float32, TINY_DIT, TINY_QWEN3, TINY_VAE
        size = args.size or (256 if args.http else 32)  # the HTTP routes take sides of 256 and more
        step_runs, image_runs = args.step_runs or 2, args.image_runs or 1
        backend = "eager"  # dynamo's tracing without inductor's C++ code generation
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S2 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, dit, text, vae = "cuda", torch.bfloat16, KLEIN_4B_DIT, QWEN3_4B, FLUX2_VAE
        size = args.size or 1024
        step_runs, image_runs, backend = args.step_runs or 10, args.image_runs or 2, "inductor"
    return Settings(smoke=args.smoke, device=device, dtype=dtype, dit=dict(dit), text=dict(text), vae=dict(vae),
                    height=size, width=size, steps=args.steps, batches=batches, step_runs=step_runs,
                    image_runs=image_runs, compile=not args.no_compile, compile_mode=args.compile_mode,
                    compile_backend=backend, runtime_compile=args.runtime_compile, seed=args.seed,
                    attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs and not args.smoke,
                    fused_kernels=args.fused_kernels and not args.smoke, http=args.http)


def vae_config(settings: Settings):
    from mstar.model.flux2.vae import Flux2VAEConfig

    return Flux2VAEConfig.from_dict(settings.vae)


def token_rows_cols(settings: Settings) -> tuple[int, int]:
    from mstar.model.flux2.vae import token_grid

    return token_grid(settings.height, settings.width, vae_config(settings).scale_factor)


# --------------------------------------------------------------------------- the bound
def dit_step_flops(dit: dict[str, Any], image_tokens: int, text_tokens: int, batch: int) -> float:
    """FLOPs of one DiT forward, counted from the shapes: every matrix product (2 per
    multiply-add) and the attention products ``QK^T`` and ``PV``; norms, modulation of the
    activations, RoPE and softmax are left out (they are not matmuls)."""
    d = dit["num_attention_heads"] * dit["attention_head_dim"]
    hidden = int(d * dit["mlp_ratio"])
    s = image_tokens + text_tokens
    per_token_block = 4 * d * d + 3 * d * hidden  # q, k, v, out + SwiGLU in (2 x hidden) and out
    attention = 4 * s * s * d  # QK^T and PV over the joint sequence
    double = 2 * s * per_token_block + attention  # the two streams' weights together see s tokens
    single = 2 * s * (d * (3 * d + 2 * hidden) + (d + hidden) * d) + attention
    embed = 2 * image_tokens * dit["in_channels"] * d + 2 * text_tokens * dit["joint_attention_dim"] * d
    out = 2 * image_tokens * d * dit["patch_size"] ** 2 * (dit["out_channels"] or dit["in_channels"])
    per_sample = dit["num_layers"] * double + dit["num_single_layers"] * single + embed + out
    return float(batch * per_sample)


def counted_flops(build: Callable[[], torch.nn.Module], run: Callable[[torch.nn.Module], Any]) -> float:
    """FLOPs of ``run(build())`` counted by torch's FLOP counter on the meta device (no memory,
    no compute: only the shapes)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        module = build()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            run(module)
    return float(counter.get_total_flops())


def text_encoder_flops(settings: Settings) -> float:
    from mstar.model.qwen3 import KLEIN_TAP_LAYERS, Qwen3Config, Qwen3TextEncoder

    config = Qwen3Config(**settings.text)
    ids = lambda: torch.zeros(1, TEXT_TOKENS, dtype=torch.int64)  # noqa: E731
    return counted_flops(lambda: Qwen3TextEncoder(config, tap_layers=KLEIN_TAP_LAYERS),
                         lambda m: m(ids()))  # no padding mask: the same products


def vae_decode_flops(settings: Settings) -> float:
    from mstar.model.flux2.vae import Flux2VAE

    cfg = vae_config(settings)
    f = cfg.scale_factor
    latents = lambda: torch.zeros(1, cfg.latent_channels, settings.height // f, settings.width // f)  # noqa: E731
    return counted_flops(lambda: Flux2VAE(cfg), lambda m: m.decode(latents()))


# ---------------------------------------------------------------------------- DiT step
def dit_inputs(settings: Settings, batch: int) -> dict[str, torch.Tensor]:
    from mstar.model.flux2.positions import text_ids

    rows, cols = token_rows_cols(settings)
    device, dtype = torch.device(settings.device), settings.dtype
    generator = torch.Generator(device=device).manual_seed(settings.seed + batch)
    img = torch.zeros(rows * cols, 4, dtype=torch.int64)
    img[:, 1] = torch.arange(rows).repeat_interleave(cols)
    img[:, 2] = torch.arange(cols).repeat(rows)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=generator).to(dtype)

    return {"hidden_states": randn(batch, rows * cols, settings.dit["in_channels"]),
            "encoder_hidden_states": randn(batch, TEXT_TOKENS, settings.dit["joint_attention_dim"]),
            "timestep": torch.full((batch,), 0.75, device=device, dtype=dtype),
            "img_ids": img.to(device), "txt_ids": text_ids(TEXT_TOKENS).to(device)}


def build_dits(settings: Settings) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours (dummy weights drawn on the device) and diffusers' model holding the same weights."""
    from diffusers import Flux2Transformer2DModel

    from mstar.model.flux2 import Flux2Transformer, Flux2TransformerConfig
    from mstar.model.weights import init_dummy_weights

    device = torch.device(settings.device)
    with torch.device(device):
        ours = Flux2Transformer(Flux2TransformerConfig.from_dict(settings.dit)).to(settings.dtype)
    init_dummy_weights(ours, seed=settings.seed)
    with torch.device("meta"):
        theirs = Flux2Transformer2DModel(**settings.dit)
    theirs = theirs.to(settings.dtype).to_empty(device=device)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours.eval(), theirs.eval()


def compiled(model: torch.nn.Module, mode: str, backend: str) -> Callable[..., Any]:
    """``model`` compiled: every repeated block in place (``regional``), or the whole of it."""
    if mode == "full":
        return torch.compile(model, dynamic=False, backend=backend)
    for name in ("transformer_blocks", "single_transformer_blocks"):
        for block in getattr(model, name):
            block.compile(dynamic=False, backend=backend)
    return model


def run_dit(settings: Settings) -> dict[str, Any]:
    """Seconds per DiT step of each variant at each batch size, and the ours/diffusers gap."""
    out: dict[str, Any] = {"compile_s": {}}
    t0 = time.perf_counter()
    ours, theirs = build_dits(settings)
    out["build_s"] = time.perf_counter() - t0
    device = torch.device(settings.device)
    variants: dict[str, Callable[..., Any]] = {"ours_eager": _scoped(settings, ours), "baseline_eager": _first(theirs)}
    inputs = {n: dit_inputs(settings, n) for n in settings.batches}
    with torch.inference_mode():
        a = variants["ours_eager"](**inputs[settings.batches[0]]).float()
        b = variants["baseline_eager"](**inputs[settings.batches[0]]).float()
    out["ours_vs_baseline_rel_err"] = ((a - b).abs().max() / b.abs().max()).item()
    log.info("DiT: ours vs diffusers max relative difference %.2e", out["ours_vs_baseline_rel_err"])
    for name, fn in list(variants.items()):
        out[name] = _time_dit(settings, fn, inputs, device)
    if settings.compile:
        # Compiling in place changes the eager modules, so the eager variants were timed first.
        for name, model in (("ours_compiled", ours), ("baseline_compiled", theirs)):
            if name == "ours_compiled" and settings.fused_kernels:
                from mstar.model.flux2.transformer import use_fused_qk_norm_rope

                use_fused_qk_norm_rope(ours)
            fn = compiled(model, settings.compile_mode, settings.compile_backend)
            call = _scoped(settings, fn) if name.startswith("ours") else _first(fn)
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    for n in settings.batches:
                        call(**inputs[n])
                synchronize(device)
                out["compile_s"][name] = time.perf_counter() - t0
                out[name] = _time_dit(settings, call, inputs, device)
            except Exception as err:  # record and go on: the other variants still count
                log.exception("%s failed", name)
                out[name] = {"error": f"{type(err).__name__}: {err}"}
    del ours, theirs, variants
    _free(settings)
    return out


def _scoped(settings: Settings, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run in ours' attention scope (the engine's ``attention_backend`` knob)."""
    from mstar.model.flux2.knobs import Flux2Knobs

    knobs = Flux2Knobs.parse({"attention_backend": settings.attention_backend})

    def call(**kwargs):
        with knobs.attention_scope():
            return fn(**kwargs)

    return call


def _first(fn: Callable[..., Any]) -> Callable[..., Any]:
    """diffusers' ``fn`` returning its output tensor: the first of its ``return_dict=False`` tuple."""
    return lambda **kwargs: fn(**kwargs, return_dict=False)[0]


def _time_dit(settings: Settings, fn: Callable[..., Any], inputs: dict[int, dict], device: torch.device) -> dict:
    result = {}
    with torch.inference_mode():
        for n in settings.batches:
            times = time_calls(functools.partial(fn, **inputs[n]), device, settings.step_runs, warmup=1)
            result[n] = statistics.median(times)
            log.info("DiT step, batch %d: %.2f ms", n, result[n] * 1e3)
    return result


# ------------------------------------------------------------------------------ image
def klein_dir(tmp: str | Path, settings: Settings) -> Path:
    """A diffusers-layout FLUX.2 [klein] directory without weights: tokenizer (byte-level,
    Qwen's special tokens and chat template), and the text encoder's, transformer's and VAE's
    ``config.json``; a ``flux2_klein`` deployment with ``load_format: dummy`` starts from it."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    from mstar.model.qwen3 import Qwen3Config

    root = Path(tmp)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    (root / "tokenizer").mkdir(parents=True, exist_ok=True)
    (root / "tokenizer" / "vocab.json").write_text(json.dumps(vocab))
    (root / "tokenizer" / "merges.txt").write_text("#version: 0.2\n")
    tok = Qwen2Tokenizer(vocab_file=str(root / "tokenizer" / "vocab.json"),
                         merges_file=str(root / "tokenizer" / "merges.txt"))
    tok.add_tokens(specials[1:], special_tokens=True)
    tok.chat_template = QWEN_CHAT_TEMPLATE
    tok.save_pretrained(root / "tokenizer")
    configs = {"text_encoder": Qwen3Config(**settings.text).to_hf_dict(),
               "transformer": {"_class_name": "Flux2Transformer2DModel", **settings.dit},
               "vae": {"_class_name": "AutoencoderKLFlux2", **asdict(vae_config(settings))}}
    for folder, config in configs.items():
        (root / folder).mkdir(exist_ok=True)
        (root / folder / "config.json").write_text(json.dumps(config, indent=2, default=list))
    return root


def deployment(settings: Settings, model_dir: Path) -> dict[str, Any]:
    """The ``flux2_klein`` deployment of the image runs (in process, and ``mstar serve``'s)."""
    kwargs: dict[str, Any] = {"max_image_area": settings.height * settings.width,
                              "num_inference_steps": settings.steps, "seed": settings.seed}
    if settings.runtime_compile:
        kwargs["compile"] = kwargs["vae_compile"] = True
    if settings.attention_backend != "sdpa":
        kwargs["attention_backend"] = settings.attention_backend
    if settings.cuda_graphs:
        kwargs["cuda_graphs"] = True
    if settings.fused_kernels:
        kwargs["fused_kernels"] = True
    return {"model": "flux2_klein", "model_path": str(model_dir), "load_format": "dummy",
            "device": settings.device, "dtype": str(settings.dtype).removeprefix("torch."),
            "max_concurrent_requests": max(settings.batches), "model_kwargs": kwargs}


class ImageRunner:
    """An in-process M* deployment of ``flux2_klein`` taking whole text-to-image requests."""

    def __init__(self, settings: Settings, model_dir: Path):
        import mstar.model.flux2.model  # noqa: F401  (registers flux2_klein)
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        config = parse_config(deployment(settings, model_dir), "s2 config")
        self.settings = settings
        self.deployment = start(config, in_process=True)
        self._counter = iter(range(1 << 30))

    async def _one(self, seed: int) -> float:
        from mstar.contract import ImageSpec

        s = self.settings
        spec = ImageSpec(f"s2-{next(self._counter)}", PROMPT, s.width, s.height, 1, seed, s.steps)
        start_s = time.perf_counter()
        [png] = await self.deployment.backend.generate_images(spec)
        if not png.startswith(b"\x89PNG"):
            raise RuntimeError("the runtime returned no PNG")
        return time.perf_counter() - start_s

    def run(self, n: int) -> tuple[float, list[float]]:
        """``n`` requests at once: the wall time of all and each one's latency."""

        async def batch() -> tuple[float, list[float]]:
            start_s = time.perf_counter()
            latencies = await asyncio.gather(*[self._one(i) for i in range(n)])
            return time.perf_counter() - start_s, list(latencies)

        return asyncio.run(batch())

    def close(self) -> None:
        self.deployment.close()
        del self.deployment


def run_images(settings: Settings, model_dir: Path) -> dict[str, Any]:
    """Seconds per image through the runtime: one request, then N submitted at once."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    runner = ImageRunner(settings, model_dir)
    out["startup_s"] = time.perf_counter() - t0
    log.info("ours: flux2_klein deployment ready in %.1f s", out["startup_s"])
    try:
        out.update(run_timed(settings, "ours", runner.run))
    finally:
        runner.close()
        del runner
        _free(settings)
    return out


def run_timed(settings: Settings, label: str, run: Callable[[int], tuple[float, list[float]]]) -> dict[str, Any]:
    """``run(n)`` (n images at once: wall seconds and each one's latency) once per batch size
    as a warm-up, then ``image_runs`` times: seconds per image (median wall / n)."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for n in settings.batches:
        run(n)
    out["warmup_s"] = time.perf_counter() - t0
    for n in settings.batches:
        runs = [run(n) for _ in range(settings.image_runs)]
        walls = [wall for wall, _ in runs]
        out[n] = {"wall_s": walls, "s_per_image": statistics.median(walls) / n,
                  "latency_s_median": statistics.median(x for _, lat in runs for x in lat)}
        log.info("%s: %d image(s) at once: %.3f s per image", label, n, out[n]["s_per_image"])
    return out


# ------------------------------------------------------------------- image over HTTP
def post_images(url: str, settings: Settings, n: int, seed: int) -> tuple[float, list[float]]:
    """``n`` concurrent ``POST /v1/images/generations`` (one image each, base64 PNG): the wall
    time of all and each one's latency (sending the request to the whole body received)."""
    import base64

    import httpx

    body = {"prompt": PROMPT, "size": f"{settings.width}x{settings.height}", "n": 1,
            "num_inference_steps": settings.steps, "response_format": "b64_json"}

    async def one(client: httpx.AsyncClient, i: int) -> float:
        start_s = time.perf_counter()
        response = await client.post(f"{url}/v1/images/generations", json={**body, "seed": seed + i})
        latency = time.perf_counter() - start_s
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
        [item] = response.json()["data"]
        if not base64.b64decode(item["b64_json"]).startswith(b"\x89PNG"):
            raise RuntimeError("the server returned no PNG")
        return latency

    async def batch() -> tuple[float, list[float]]:
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
            start_s = time.perf_counter()
            latencies = await asyncio.gather(*[one(client, i) for i in range(n)])
            return time.perf_counter() - start_s, list(latencies)

    return asyncio.run(batch())


def run_http(settings: Settings, model_dir: Path, workdir: Path) -> dict[str, Any]:
    """Seconds per image through ``mstar serve flux2_klein``: the in-process runs' requests,
    over HTTP."""
    t0 = time.perf_counter()
    server = ServerProcess("flux2_klein", deployment(settings, model_dir), workdir)
    startup_s = time.perf_counter() - t0
    log.info("ours over HTTP: server healthy in %.1f s", startup_s)
    seeds = iter(range(settings.seed, settings.seed + (1 << 30), 1000))
    try:
        out = run_timed(settings, "ours over HTTP", lambda n: post_images(server.url, settings, n, next(seeds)))
    except Exception:
        log.error("server log tail:\n%s", server.log_tail())
        raise
    finally:
        server.close()
    out["startup_s"] = startup_s
    return out


# ------------------------------------------------------------ image: diffusers' pipeline
def build_pipeline(settings: Settings, model_dir: Path):
    """diffusers' ``Flux2KleinPipeline`` with S2's configs (the DiT baseline's, the text
    encoder's and the VAE's) and random weights drawn on the device, in ``dtype``; its
    tokenizer is the one ``klein_dir`` wrote (ours reads the same)."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    device = torch.device(settings.device)
    default = torch.get_default_dtype()
    torch.set_default_dtype(settings.dtype)  # built in dtype on the device: no float32 copy, no CPU init
    try:
        with torch.device(device):
            text_encoder = Qwen3ForCausalLM(Qwen3Config(**settings.text))
            transformer = Flux2Transformer2DModel(**settings.dit)
            vae = AutoencoderKLFlux2(**diffusers_vae_config(settings))
    finally:
        torch.set_default_dtype(default)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=True)
    for module in (text_encoder, transformer, vae):
        module.eval().requires_grad_(False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_vae_config(settings: Settings) -> dict[str, Any]:
    """``AutoencoderKLFlux2``'s arguments for S2's VAE: one encoder and one decoder block type
    per width (diffusers' defaults assume four widths; the tiny VAE has two)."""
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(vae_config(settings)).items()}
    blocks = len(config["block_out_channels"])
    return {**config, "down_block_types": ["DownEncoderBlock2D"] * blocks,
            "up_block_types": ["UpDecoderBlock2D"] * blocks}


def run_pipeline(settings: Settings, model_dir: Path) -> dict[str, Any]:
    """Seconds per image of diffusers' pipeline: N prompts as one batch, 4 steps, no guidance
    (klein is distilled); its transformer blocks and VAE decoder compiled as S2 compiles the
    DiT baseline, unless ``--no-compile``."""
    import io

    t0 = time.perf_counter()
    pipe = build_pipeline(settings, model_dir)
    held: dict[str, Any] = {"pipe": pipe}  # dropped in `finally`, which frees the GPU memory
    startup_s = time.perf_counter() - t0
    if settings.compile:
        for name in ("transformer_blocks", "single_transformer_blocks"):
            for block in getattr(pipe.transformer, name):
                block.compile(dynamic=False, backend=settings.compile_backend)
        pipe.vae.decoder.compile(dynamic=False, backend=settings.compile_backend)
    log.info("baseline: Flux2KleinPipeline built in %.1f s (compiled: %s)", startup_s, settings.compile)
    device = torch.device(settings.device)
    del pipe

    def run(n: int) -> tuple[float, list[float]]:
        generator = torch.Generator(device=device).manual_seed(settings.seed)
        synchronize(device)
        start_s = time.perf_counter()
        with torch.inference_mode():
            result = held["pipe"](prompt=[PROMPT] * n, height=settings.height, width=settings.width,
                                  num_inference_steps=settings.steps, guidance_scale=1.0, generator=generator,
                                  max_sequence_length=TEXT_TOKENS, output_type="pil")
        synchronize(device)
        wall = time.perf_counter() - start_s
        if len(result.images) != n:
            raise RuntimeError(f"the pipeline made {len(result.images)} images, not {n}")
        held["image"] = result.images[0]
        return wall, [wall] * n

    try:
        out = run_timed(settings, "baseline (diffusers pipeline)", run)
        buffer = io.BytesIO()
        t0 = time.perf_counter()
        held["image"].save(buffer, format="PNG")
        out["png_encode_s"] = time.perf_counter() - t0
    finally:
        held.clear()
        _free(settings)
    out["startup_s"] = startup_s
    out["compiled"] = settings.compile
    return out


def _free(settings: Settings) -> None:
    gc.collect()
    if settings.device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- report
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny model, CPU)" if settings.smoke else SCENARIO


def metrics_from(settings: Settings, tflops: float, flops: dict[str, Any], dit: dict | None,
                 images: dict | None, pipeline: dict | None = None, http: dict | None = None) -> list[Metric]:
    rows: list[Metric] = []
    scenario = scenario_name(settings)
    rate = tflops * 1e12
    for n in settings.batches:
        floor_ms = flops["dit_step"][n] / rate * 1e3
        for kind in ("eager", "compiled"):
            if kind == "compiled" and not settings.compile:
                continue
            row = Metric(scenario, f"dit_step@{n} {kind}", "ms", "lower", floor=floor_ms)
            for side in ("ours", "baseline"):
                value = (dit or {}).get(f"{side}_{kind}", {})
                if n in value:
                    setattr(row, side, value[n] * 1e3)
                elif "error" in value:
                    row.notes[f"{side}_error"] = value["error"]
            rows.append(row)
    sides = [("", images)] + ([(" http", http)] if settings.http else [])
    for suffix, ours in sides:
        for n in settings.batches:
            floor_s = (settings.steps * flops["dit_step"][n] + n * (flops["text_encoder"] + flops["vae_decode"])) / rate
            row = Metric(scenario, f"image@{n}{suffix}", "s/image", "lower", floor=floor_s / n)
            row.notes["runtime_compile"] = settings.runtime_compile
            row.notes["cuda_graphs"] = settings.cuda_graphs
            row.notes["fused_kernels"] = settings.fused_kernels
            row.notes["ours_is"] = ("POST /v1/images/generations to an mstar serve process, n requests at once"
                                    if suffix else "requests submitted to an in-process deployment")
            if ours and n in ours:
                row.ours = ours[n]["s_per_image"]
                row.notes.update({f"ours_{k}": v for k, v in ours[n].items()})
            if pipeline and n in pipeline:
                row.baseline = pipeline[n]["s_per_image"]
                row.notes["baseline_is"] = (f"diffusers Flux2KleinPipeline, {n} prompt(s) as one batch, "
                                            f"{'compiled' if pipeline['compiled'] else 'eager'}, PIL images out "
                                            "(no PNG encoding)")
                row.notes["baseline_png_encode_s"] = pipeline.get("png_encode_s")
                row.notes.update({f"baseline_{k}": v for k, v in pipeline[n].items()})
            rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the code paths)")
    p.add_argument("--batches", default=None, help="DiT batch sizes and concurrent images (default 1,4)")
    p.add_argument("--size", type=int, default=None, help="image width = height (default 1024; smoke 32)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per image")
    p.add_argument("--step-runs", type=int, default=None,
                   help="timed DiT steps per variant and batch size, median (default 10; smoke 2)")
    p.add_argument("--image-runs", type=int, default=None,
                   help="timed runs per concurrency, median (default 2; smoke 1)")
    p.add_argument("--no-compile", action="store_true", help="time the eager DiTs only")
    p.add_argument("--compile-mode", choices=("regional", "full"), default="regional",
                   help="compile every block (as diffusers' compile_repeated_blocks) or the whole model")
    p.add_argument("--attention-backend", choices=("sdpa", "cudnn"), default="sdpa",
                   help="ours' DiT attention (model_kwargs.attention_backend); diffusers keeps PyTorch's choice")
    p.add_argument("--runtime-compile", action="store_true",
                   help="model_kwargs.compile and vae_compile=true for the image runs")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="model_kwargs.cuda_graphs=true for the image runs (GPU only; ignored with --smoke)")
    p.add_argument("--fused-kernels", action="store_true",
                   help="ours' QK-norm + RoPE Triton kernel in the compiled DiT steps and the image runs (GPU only)")
    p.add_argument("--skip-dit", action="store_true", help="do not time DiT steps")
    p.add_argument("--skip-images", action="store_true", help="do not time whole images through the runtime")
    p.add_argument("--skip-pipeline", action="store_true",
                   help="do not time diffusers' Flux2KleinPipeline (the whole-image baseline)")
    p.add_argument("--http", action="store_true",
                   help="also time whole images through an `mstar serve` process (POST /v1/images/generations)")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(args)
    started = time.perf_counter()
    log.info("S2 settings: %s", settings.describe())

    tflops = measure_matmul_tflops(settings.device, settings.dtype)
    rows, cols = token_rows_cols(settings)
    flops = {"dit_step": {n: dit_step_flops(settings.dit, rows * cols, TEXT_TOKENS, n) for n in settings.batches},
             "text_encoder": text_encoder_flops(settings), "vae_decode": vae_decode_flops(settings)}
    log.info("measured %.1f TFLOP/s; DiT step %.1f TFLOP per image, text encoder %.2f, VAE decode %.2f",
             tflops, flops["dit_step"][settings.batches[0]] / settings.batches[0] / 1e12,
             flops["text_encoder"] / 1e12, flops["vae_decode"] / 1e12)

    dit = images = pipeline = http = None
    errors: dict[str, str] = {}
    if not args.skip_dit:
        dit = run_dit(settings)
    if not args.skip_images or settings.http:
        with tempfile.TemporaryDirectory(prefix="s2-klein-") as tmp:
            model_dir = klein_dir(Path(tmp) / "model", settings)
            if not args.skip_images:
                images = run_images(settings, model_dir)
                if not args.skip_pipeline:
                    try:
                        pipeline = run_pipeline(settings, model_dir)
                    except Exception as err:  # keep ours' numbers when the baseline cannot run
                        log.exception("the diffusers pipeline baseline failed")
                        errors["pipeline baseline"] = f"{type(err).__name__}: {err}"
            if settings.http:
                try:
                    http = run_http(settings, model_dir, Path(tmp))
                except Exception as err:
                    log.exception("the HTTP runs failed")
                    errors["http"] = f"{type(err).__name__}: {err}"

    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"matmul_tflops": tflops, "image_tokens": rows * cols, "text_tokens": TEXT_TOKENS,
                     "flops": {k: ({str(n): f for n, f in v.items()} if isinstance(v, dict) else v)
                               for k, v in flops.items()}},
        "metrics": metrics_from(settings, tflops, flops, dit, images, pipeline, http),
        "dit": None if dit is None else {k: ({str(n): x for n, x in v.items()} if isinstance(v, dict) else v)
                                         for k, v in dit.items()},
        "images": None if images is None else {str(k): v for k, v in images.items()},
        "pipeline": None if pipeline is None else {str(k): v for k, v in pipeline.items()},
        "http": None if http is None else {str(k): v for k, v in http.items()},
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S2 done in %.1f s", record["total_s"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
