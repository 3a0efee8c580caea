"""S8: Wan2.2-TI2V-5B: seconds per DiT step and per whole clip, against diffusers.

Wan2.2-TI2V-5B shapes (DiT: 30 blocks, 24 heads of 128, FFN 14336, 48 latent channels in 1x2x2
patches; UMT5-XXL prompt encoder, 512 tokens; the Wan2.2 VAE, 16x space and 4x time), random
("dummy") weights, bf16 on one GPU (the VAE in float32, as the model card loads it), 832x480 x 33
frames by default: latents [48, 9, 30, 52], 9 x 15 x 26 = 3,510 DiT tokens beside 512 text tokens.

* **DiT step**: one forward of the transformer on random latents, per-token times (TI2V's
  ``expand_timesteps``) and text features, batch 1 and 2 (2 = a guided request's pair).
  ``ours`` is ``mstar.model.wan22.WanTransformer`` eager and compiled (every block, as the
  engine's ``compile`` knob does); ``baseline`` is diffusers' ``WanTransformer3DModel`` holding
  the same weights, eager and compiled the same way (diffusers' ``compile_repeated_blocks``).
  Both keep the time MLP and modulation tables in float32 (diffusers' ``_keep_in_fp32_modules``).
  Their outputs are compared, as a check that both compute the same function.
* **clip**: a whole text-to-video request (UMT5, N UniPC steps with guidance 5 as a batched
  pair, VAE decode to uint8 frames) through an in-process M* deployment of ``wan22``; baseline:
  diffusers' ``WanPipeline`` (``expand_timesteps=True``, the same configs and random weights,
  ``output_type="np"``), eager and with its transformer blocks compiled. A 2-step request first
  warms each side up (compiles). No mp4 encoding on either side.
* **floor**: DiT FLOPs per step (matmuls and attention, from the shapes) over the measured bf16
  matmul rate; per clip, N guided steps plus the text encoder's and the VAE decoder's FLOPs
  (torch's FLOP counter on the meta device; the decoder's at the TF32 rate cuDNN convolves at).

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
    add_run_args,
    hardware,
    measure_matmul_tflops,
    setup_logging,
    synchronize,
    time_calls,
    write_record,
)

NAME = "s8_wan22"
SCENARIO = "S8 wan2.2-ti2v-5B"
TEXT_TOKENS = 512  # the pipeline pads every prompt to 512 tokens
GUIDANCE = 5.0
PROMPT = "a red fox trotting through fresh snow at dawn, the camera following low"

log = logging.getLogger("s8")

# The checkpoint's transformer/config.json (Wan-AI/Wan2.2-TI2V-5B-Diffusers).
TI2V_5B_DIT: dict[str, Any] = {
    "patch_size": [1, 2, 2], "num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48,
    "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 14336, "num_layers": 30,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
}
# UMT5-XXL's encoder (text_encoder/config.json).
UMT5_XXL: dict[str, Any] = {
    "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
}
# The Wan2.2 VAE (vae/config.json; latent statistics replaced by 0 and 1: the weights are random).
WAN22_VAE: dict[str, Any] = {
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": True,
    "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_temporal": 4,
    "scale_factor_spatial": 16, "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48,
}
TINY_DIT: dict[str, Any] = {**TI2V_5B_DIT, "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4,
                            "out_channels": 4, "text_dim": 32, "freq_dim": 32, "ffn_dim": 40, "num_layers": 2,
                            "rope_max_seq_len": 64}
TINY_UMT5: dict[str, Any] = {**UMT5_XXL, "vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2,
                             "num_heads": 4, "relative_attention_num_buckets": 8,
                             "relative_attention_max_distance": 16}
TINY_VAE: dict[str, Any] = {**WAN22_VAE, "base_dim": 4, "decoder_base_dim": 6, "z_dim": 4, "num_res_blocks": 1,
                            "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}
SCHEDULER: dict[str, Any] = {  # scheduler/scheduler_config.json
    "_class_name": "UniPCMultistepScheduler", "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001,
    "disable_corrector": [], "dynamic_thresholding_ratio": 0.995, "final_sigmas_type": "zero", "flow_shift": 5.0,
    "lower_order_final": True, "num_train_timesteps": 1000, "predict_x0": True, "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False, "sample_max_value": 1.0, "solver_order": 2, "solver_p": None,
    "solver_type": "bh2", "steps_offset": 0, "thresholding": False, "timestep_spacing": "linspace",
    "trained_betas": None, "use_beta_sigmas": False, "use_exponential_sigmas": False, "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}
MODEL_INDEX: dict[str, Any] = {
    "_class_name": "WanPipeline", "boundary_ratio": None, "expand_timesteps": True,
    "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
    "transformer_2": [None, None], "vae": ["diffusers", "AutoencoderKLWan"],
}


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
    frames: int
    steps: int
    batches: tuple[int, ...]
    step_runs: int
    clip_runs: int
    compile: bool
    compile_backend: str
    runtime_compile: bool
    vae_compile: bool = False
    attention_backend: str = "sdpa"
    fused_kernels: bool = False
    vae_dtype: str = "float32"
    vae_channels_last: bool = True
    seed: int = 0

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        out["batches"] = list(self.batches)
        out["text_tokens"] = TEXT_TOKENS
        out["guidance_scale"] = GUIDANCE
        return out

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(channels, frames, rows, columns) of the clip's latents."""
        f = self.vae["scale_factor_spatial"]
        return (self.dit["in_channels"], (self.frames - 1) // self.vae["scale_factor_temporal"] + 1,
                self.height // f, self.width // f)

    @property
    def tokens(self) -> int:
        _, frames, rows, cols = self.latent_shape
        pt, ph, pw = self.dit["patch_size"]
        return frames // pt * (rows // ph) * (cols // pw)


def settings_from(args: argparse.Namespace) -> Settings:
    batches = tuple(sorted({int(b) for b in args.batches.split(",")})) if args.batches else (1, 2)
    if args.smoke:
        device, dtype, dit, text, vae = "cpu", torch.float32, TINY_DIT, TINY_UMT5, TINY_VAE
        width, height, frames = args.width or 64, args.height or 32, args.frames or 5
        steps, step_runs, clip_runs, backend = args.steps or 2, args.step_runs or 2, args.clip_runs or 1, "eager"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S8 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, dit, text, vae = "cuda", torch.bfloat16, TI2V_5B_DIT, UMT5_XXL, WAN22_VAE
        width, height, frames = args.width or 832, args.height or 480, args.frames or 33
        steps, step_runs, clip_runs, backend = args.steps or 50, args.step_runs or 10, args.clip_runs or 1, "inductor"
    return Settings(smoke=args.smoke, device=device, dtype=dtype, dit=dict(dit), text=dict(text), vae=dict(vae),
                    height=height, width=width, frames=frames, steps=steps, batches=batches, step_runs=step_runs,
                    clip_runs=clip_runs, compile=not args.no_compile, compile_backend=backend,
                    runtime_compile=args.runtime_compile, vae_compile=args.vae_compile and not args.smoke,
                    attention_backend=args.attention_backend, fused_kernels=args.fused_kernels and not args.smoke,
                    vae_dtype=args.vae_dtype, seed=args.seed, vae_channels_last=not args.vae_contiguous)


# --------------------------------------------------------------------------- the bound
def dit_step_flops(dit: dict[str, Any], tokens: int, text_tokens: int, batch: int) -> float:
    """FLOPs of one DiT forward, counted from the shapes: every matrix product (2 per
    multiply-add) and the attention products (``QK^T`` and ``PV``, self and cross); norms,
    modulation, RoPE and softmax are left out. The time MLP counts twice per row: ours embeds
    each row's smallest and largest time (TI2V's per-token times take those two values)."""
    d = dit["num_attention_heads"] * dit["attention_head_dim"]
    per_token = 4 * d * d + 2 * d * d + 2 * d * dit["ffn_dim"]  # self q,k,v,o; cross q,o; FFN in and out
    kv_text = 2 * text_tokens * d * d  # cross-attention's k and v over the text
    attention = 2 * tokens * tokens * d + 2 * tokens * text_tokens * d  # multiply-adds of QK^T and PV
    block = 2 * tokens * per_token + 2 * kv_text + 2 * attention
    patch = dit["in_channels"] * dit["patch_size"][0] * dit["patch_size"][1] * dit["patch_size"][2]
    embed = 2 * tokens * patch * d + 2 * text_tokens * (dit["text_dim"] * d + d * d)  # patches; text MLP
    out = 2 * tokens * d * patch * dit["out_channels"] // dit["in_channels"]
    time = 2 * 2 * (dit["freq_dim"] * d + d * d + d * 6 * d)  # the time MLP and its modulation, two times a row
    return float(batch * (dit["num_layers"] * block + embed + out + time))


def tf32_tflops(device: str) -> float:
    """The float32 product rate the VAE's convolutions get: cuDNN takes TF32 for them by default
    (``torch.backends.cudnn.allow_tf32``), so the matmul is timed with TF32 allowed."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32
    try:
        return measure_matmul_tflops(device, torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def counted_flops(build: Callable[[], torch.nn.Module], run: Callable[[torch.nn.Module], Any]) -> float:
    """FLOPs of ``run(build())`` by torch's FLOP counter on the meta device (shapes only)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        module = build()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            run(module)
    return float(counter.get_total_flops())


def text_encoder_flops(settings: Settings) -> float:
    from mstar.model.wan22.umt5 import UMT5Config, UMT5Encoder

    ids = lambda: torch.zeros(1, TEXT_TOKENS, dtype=torch.int64)  # noqa: E731
    return counted_flops(lambda: UMT5Encoder(UMT5Config.from_dict(settings.text)), lambda m: m(ids(), ids() + 1))


def vae_decode_flops(settings: Settings) -> float:
    from mstar.model.wan22.vae import WanVAE, WanVAEConfig

    z = lambda: torch.zeros(1, *settings.latent_shape)  # noqa: E731
    return counted_flops(lambda: WanVAE(WanVAEConfig.from_dict(settings.vae)), lambda m: m.decode(z()))


# ---------------------------------------------------------------------------- DiT step
def keep_fp32(model: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Module:
    """Parameters with one of ``names`` among the parts of their name back in float32."""
    for name, param in model.named_parameters():
        if not set(names).isdisjoint(name.split(".")):
            param.data = param.data.float()
    return model


def cast_keeping(model: torch.nn.Module, dtype: torch.dtype, names: tuple[str, ...]) -> torch.nn.Module:
    """``model`` (built in float32) in ``dtype`` but for the parameters and buffers with one of
    ``names`` among the parts of their name: diffusers' ``from_pretrained(torch_dtype=...)`` with
    its ``_keep_in_fp32_modules`` (the rotary tables among them)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if set(names).isdisjoint(name.split(".")) and tensor.is_floating_point():
            tensor.data = tensor.data.to(dtype)
    return model


def build_dits(settings: Settings) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours (dummy weights drawn on the device) and diffusers' model holding the same weights."""
    from diffusers import WanTransformer3DModel

    from mstar.model.wan22.config import WanTransformerConfig
    from mstar.model.wan22.engine import FP32_PARAMETERS
    from mstar.model.wan22.transformer import WanTransformer
    from mstar.model.weights import init_dummy_weights

    device = torch.device(settings.device)
    with torch.device(device):
        ours = WanTransformer(WanTransformerConfig.from_dict(settings.dit)).to(settings.dtype)
    keep_fp32(ours, FP32_PARAMETERS)
    init_dummy_weights(ours, seed=settings.seed)
    with torch.device(device):  # not on the meta device: its rotary tables are computed buffers
        theirs = WanTransformer3DModel(**settings.dit)
    theirs = cast_keeping(theirs, settings.dtype, tuple(theirs._keep_in_fp32_modules))
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours.eval(), theirs.eval()


def dit_inputs(settings: Settings, batch: int) -> dict[str, torch.Tensor]:
    device, dtype = torch.device(settings.device), settings.dtype
    generator = torch.Generator(device=device).manual_seed(settings.seed + batch)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=generator).to(dtype)

    t = torch.full((batch, settings.tokens), 700.0, device=device)
    t[:, : settings.tokens // settings.latent_shape[1]] = 0.0  # TI2V: an i2v request's first frame at time 0
    return {"latents": randn(batch, *settings.latent_shape), "t": t,
            "text": randn(batch, TEXT_TOKENS, settings.dit["text_dim"])}


def run_dit(settings: Settings) -> dict[str, Any]:
    """Seconds per DiT step of each variant at each batch size, and the ours/diffusers gap."""
    out: dict[str, Any] = {"compile_s": {}}
    t0 = time.perf_counter()
    ours, theirs = build_dits(settings)
    out["build_s"] = time.perf_counter() - t0
    device = torch.device(settings.device)
    variants = {"ours_eager": _scoped(settings, ours), "baseline_eager": _theirs(theirs)}
    inputs = {n: dit_inputs(settings, n) for n in settings.batches}
    with torch.inference_mode():
        a = variants["ours_eager"](**inputs[settings.batches[0]]).float()
        b = variants["baseline_eager"](**inputs[settings.batches[0]]).float()
    out["ours_vs_baseline_rel_err"] = ((a - b).abs().max() / b.abs().max()).item()
    log.info("DiT: ours vs diffusers max relative difference %.2e", out["ours_vs_baseline_rel_err"])
    for name, fn in list(variants.items()):
        out[name] = _time_dit(settings, name, fn, inputs, device)
    if settings.compile:
        # Compiling in place changes the eager modules, so the eager variants were timed first.
        from mstar.model.wan22.transformer import use_fused_kernels

        use_fused_kernels(ours, settings.fused_kernels)
        for model in (ours, theirs):  # compiled lazily, at each variant's first call below
            for block in model.blocks:
                block.compile(dynamic=False, backend=settings.compile_backend)
        # A text-to-video step as ours' engine runs it: one time per row, which the DiT
        # broadcasts over the tokens (the baseline takes the same time per token).
        row_time = {n: {**x, "t": x["t"][:, -1:]} for n, x in inputs.items()}
        for name, model, feed in (("ours_compiled", ours, inputs), ("ours_compiled_row_time", ours, row_time),
                                  ("baseline_compiled", theirs, inputs)):
            call = _scoped(settings, model) if name.startswith("ours") else _theirs(model)
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    for n in settings.batches:
                        call(**feed[n])
                synchronize(device)
                out["compile_s"][name] = time.perf_counter() - t0
                out[name] = _time_dit(settings, name, call, feed, device)
            except Exception as err:  # record and go on: the other variants still count
                log.exception("%s failed", name)
                out[name] = {"error": f"{type(err).__name__}: {err}"}
    del ours, theirs, variants
    _free(settings)
    return out


def _scoped(settings: Settings, model: torch.nn.Module) -> Callable[..., Any]:
    """Ours run in its attention scope (the engine's ``attention_backend`` knob)."""
    from mstar.model.wan22.knobs import WanKnobs

    knobs = WanKnobs.parse({"attention_backend": settings.attention_backend})

    def call(latents, t, text):
        with knobs.attention_scope():
            return model(latents, t, text)

    return call


def _theirs(model: torch.nn.Module) -> Callable[..., Any]:
    return lambda latents, t, text: model(hidden_states=latents, timestep=t, encoder_hidden_states=text,
                                          return_dict=False)[0]


def _time_dit(settings: Settings, label: str, fn: Callable[..., Any], inputs: dict[int, dict],
              device: torch.device) -> dict:
    result = {}
    with torch.inference_mode():
        for n in settings.batches:
            times = time_calls(functools.partial(fn, **inputs[n]), device, settings.step_runs, warmup=1)
            result[n] = statistics.median(times)
            log.info("%s DiT step, batch %d: %.2f ms", label, n, result[n] * 1e3)
    return result


# ------------------------------------------------------------------------------- clips
def t5_tokenizer():
    """A small unigram T5 tokenizer (``<pad>`` 0, ``</s>`` 1, letters and a few words): the
    prompt's token count, not its vocabulary, is what the clip's cost depends on (both sides pad
    to 512)."""
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(c, -5.0 - i / 10) for i, c in enumerate("▁abcdefghijklmnopqrstuvwxyz,.")]
    return T5TokenizerFast(vocab=vocab, extra_ids=0)


def wan_dir(tmp: str | Path, settings: Settings) -> Path:
    """A diffusers-layout Wan2.2-TI2V directory without weights (configs, tokenizer,
    scheduler); a ``wan22`` deployment with ``load_format: dummy`` starts from it."""
    from transformers import UMT5Config

    root = Path(tmp)
    t5_tokenizer().save_pretrained(root / "tokenizer")
    configs = {"transformer": {"_class_name": "WanTransformer3DModel", **settings.dit},
               "vae": {"_class_name": "AutoencoderKLWan", **settings.vae},
               "text_encoder": UMT5Config(**settings.text).to_dict()}
    for folder, config in configs.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "config.json").write_text(json.dumps(config, indent=2))
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX))
    return root


def deployment(settings: Settings, model_dir: Path, vae_dtype: str = "float32") -> dict[str, Any]:
    area = settings.width * settings.height
    kwargs: dict[str, Any] = {"num_inference_steps": settings.steps, "guidance_scale": GUIDANCE,
                              "max_image_area": area, "max_video_pixels": area * settings.frames,
                              "seed": settings.seed}
    if settings.runtime_compile:
        kwargs["compile"] = True
    if settings.vae_compile:
        kwargs["vae_compile"] = True
    if settings.attention_backend != "sdpa":
        kwargs["attention_backend"] = settings.attention_backend
    if settings.fused_kernels:
        kwargs["fused_kernels"] = True
    if vae_dtype != "float32":
        kwargs["vae_dtype"] = vae_dtype
    if not settings.vae_channels_last:
        kwargs["vae_channels_last"] = False
    return {"model": "wan22", "model_path": str(model_dir), "load_format": "dummy", "device": settings.device,
            "dtype": str(settings.dtype).removeprefix("torch."), "max_concurrent_requests": 2,
            "model_kwargs": kwargs}


class OursClips:
    """An in-process ``wan22`` deployment (or, for a ``config`` that places nodes with
    ``node_groups``, e.g. the DiT split by SP, one with its ranks in worker processes);
    ``clip(steps)`` makes one text-to-video clip and returns its seconds."""

    def __init__(self, settings: Settings, model_dir: Path, vae_dtype: str = "float32",
                 config: dict[str, Any] | None = None) -> None:
        import mstar.model.wan22.model  # noqa: F401  (registers wan22)
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        t0 = time.perf_counter()
        config = config or deployment(settings, model_dir, vae_dtype)
        self.settings = settings
        self.deployment = start(parse_config(config, "s8 config"), in_process=not config.get("node_groups"))
        self.startup_s = time.perf_counter() - t0
        self.counter = iter(range(1 << 30))

    def clip(self, steps: int) -> float:
        from mstar.contract import GenerateSpec

        settings = self.settings

        async def run() -> int:
            spec = GenerateSpec(f"s8-{next(self.counter)}", PROMPT, [], ["video"],
                                {"height": settings.height, "width": settings.width, "num_frames": settings.frames,
                                 "num_inference_steps": steps, "seed": settings.seed})
            size = 0
            async for event in self.deployment.backend.generate(spec):
                if event.error:
                    raise RuntimeError(event.error)
                size += len(event.data or b"")
            return size

        start_s = time.perf_counter()
        size = asyncio.run(run())
        expected = settings.frames * settings.height * settings.width * 3
        if size != expected:
            raise RuntimeError(f"the runtime returned {size} bytes of frames, not {expected}")
        return time.perf_counter() - start_s

    def close(self) -> None:
        self.deployment.close()
        _free(self.settings)


def run_ours(settings: Settings, model_dir: Path, vae_dtype: str = "float32",
             config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Seconds per clip through ``OursClips`` (a short warm-up request first), its VAE in
    ``vae_dtype``."""
    ours = OursClips(settings, model_dir, vae_dtype, config)
    out: dict[str, Any] = {"startup_s": ours.startup_s, "vae_dtype": vae_dtype}
    log.info("ours: wan22 deployment ready in %.1f s", out["startup_s"])
    clip = ours.clip
    try:
        t0 = time.perf_counter()
        clip(2)
        out["warmup_s"] = time.perf_counter() - t0
        out["s_per_clip"] = [clip(settings.steps) for _ in range(settings.clip_runs)]
        # A 2-step clip splits the clip: per step (the difference over the steps between) and the
        # rest (UMT5, the VAE decode, the host's work around them).
        out["s_per_2_step_clip"] = clip(2)
        per_step = (statistics.median(out["s_per_clip"]) - out["s_per_2_step_clip"]) / max(settings.steps - 2, 1)
        out["s_per_step"], out["s_outside_steps"] = per_step, out["s_per_2_step_clip"] - 2 * per_step
        log.info("ours: %.2f s per clip (%.1f ms a step, %.2f s outside the steps)",
                 statistics.median(out["s_per_clip"]), per_step * 1e3, out["s_outside_steps"])
    finally:
        ours.close()
    return out


def build_pipeline(settings: Settings, model_dir: Path):
    """diffusers' ``WanPipeline`` (TI2V: ``expand_timesteps``) with S8's configs and random
    weights drawn on the device: the DiT and UMT5 in ``dtype``, the VAE in float32."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    device = torch.device(settings.device)
    default = torch.get_default_dtype()
    torch.set_default_dtype(settings.dtype)  # built in dtype on the device: no float32 copy, no CPU init
    try:
        with torch.device(device):
            text_encoder = UMT5EncoderModel(UMT5Config(**settings.text))
    finally:
        torch.set_default_dtype(default)
    with torch.device(device):  # float32 first: the rotary tables are computed buffers
        transformer = WanTransformer3DModel(**settings.dit)
        vae = AutoencoderKLWan(**settings.vae)
    cast_keeping(transformer, settings.dtype, tuple(transformer._keep_in_fp32_modules))
    pipe = WanPipeline(tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"), text_encoder=text_encoder,
                       vae=vae, transformer=transformer, scheduler=UniPCMultistepScheduler.from_config(SCHEDULER),
                       expand_timesteps=True)
    for module in (text_encoder, transformer, vae):
        module.eval().requires_grad_(False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pipeline(settings: Settings, model_dir: Path, compiled: bool) -> dict[str, Any]:
    """Seconds per clip of diffusers' pipeline, eager or with its transformer blocks compiled (a
    2-step warm-up first)."""
    t0 = time.perf_counter()
    held: dict[str, Any] = {"pipe": build_pipeline(settings, model_dir)}  # dropped in `finally`
    out: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "compiled": compiled}
    if compiled:
        for block in held["pipe"].transformer.blocks:
            block.compile(dynamic=False, backend=settings.compile_backend)
    device = torch.device(settings.device)

    def clip(steps: int) -> float:
        generator = torch.Generator(device=device).manual_seed(settings.seed)
        synchronize(device)
        start_s = time.perf_counter()
        with torch.inference_mode():
            result = held["pipe"](prompt=PROMPT, negative_prompt="", height=settings.height, width=settings.width,
                                  num_frames=settings.frames, num_inference_steps=steps, guidance_scale=GUIDANCE,
                                  generator=generator, output_type="np", max_sequence_length=TEXT_TOKENS)
        synchronize(device)
        frames = result.frames[0]
        if frames.shape[:3] != (settings.frames, settings.height, settings.width):
            raise RuntimeError(f"the pipeline made frames of shape {frames.shape}")
        return time.perf_counter() - start_s

    label = f"baseline ({'compiled' if compiled else 'eager'} WanPipeline)"
    try:
        t0 = time.perf_counter()
        clip(2)
        out["warmup_s"] = time.perf_counter() - t0
        out["s_per_clip"] = [clip(settings.steps) for _ in range(settings.clip_runs)]
        log.info("%s: %.2f s per clip", label, statistics.median(out["s_per_clip"]))
    finally:
        held.clear()
        _free(settings)
    return out


def _free(settings: Settings) -> None:
    gc.collect()
    if settings.device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- report
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny model, CPU)" if settings.smoke else SCENARIO


# The DiT step rows: (metric label, (ours' variant, the baseline's variant) in ``run_dit``'s result)
DIT_ROWS = (("eager", ("ours_eager", "baseline_eager")),
            ("compiled", ("ours_compiled", "baseline_compiled")),
            ("compiled, ours with one time per row (t2v)", ("ours_compiled_row_time", "baseline_compiled")))


def metrics_from(settings: Settings, rates: dict[str, float], flops: dict[str, Any], dit: dict | None,
                 ours: dict | None, pipelines: dict[str, dict], ours_more: dict[str, dict] | None = None
                 ) -> list[Metric]:
    rows: list[Metric] = []
    scenario = scenario_name(settings)
    for n in settings.batches:
        floor_ms = flops["dit_step"][n] / (rates["bf16"] * 1e12) * 1e3
        for label, keys in DIT_ROWS:
            if label != "eager" and not settings.compile:
                continue
            row = Metric(scenario, f"dit_step@{n} {label}", "ms", "lower", floor=floor_ms)
            for side, key in zip(("ours", "baseline"), keys, strict=True):
                value = (dit or {}).get(key, {})
                if n in value:
                    setattr(row, side, value[n] * 1e3)
                elif "error" in value:
                    row.notes[f"{side}_error"] = value["error"]
            rows.append(row)
    floor_s = (settings.steps * flops["dit_step"][2] + flops["text_encoder"] * 2) / (rates["bf16"] * 1e12) \
        + flops["vae_decode"] / (rates["fp32"] * 1e12)
    for kind, pipeline in pipelines.items():
        row = Metric(scenario, f"clip {kind} baseline", "s/clip", "lower", floor=floor_s)
        if ours:
            row.ours = statistics.median(ours["s_per_clip"])
            row.notes.update({"ours_runtime_compile": settings.runtime_compile,
                              "ours_vae_compile": settings.vae_compile, "ours_fused_kernels": settings.fused_kernels,
                              "ours_vae_dtype": ours["vae_dtype"], "ours_s_per_clip": ours["s_per_clip"]})
        if "s_per_clip" in pipeline:
            row.baseline = statistics.median(pipeline["s_per_clip"])
            row.notes["baseline_s_per_clip"] = pipeline["s_per_clip"]
        row.notes["baseline_is"] = f"diffusers WanPipeline (expand_timesteps), {kind}, output_type np"
        row.notes["clip"] = f"{settings.width}x{settings.height}x{settings.frames}, {settings.steps} steps, CFG 5"
        rows.append(row)
        for dtype, more in (ours_more or {}).items():  # ours again with another VAE dtype
            extra = Metric(scenario, f"clip {kind} baseline, ours' VAE {dtype}", "s/clip", "lower", floor=floor_s)
            extra.ours, extra.baseline = statistics.median(more["s_per_clip"]), row.baseline
            extra.notes = {**row.notes, "ours_vae_dtype": dtype, "ours_s_per_clip": more["s_per_clip"]}
            rows.append(extra)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the code paths)")
    p.add_argument("--batches", default=None, help="DiT batch sizes (default 1,2)")
    p.add_argument("--width", type=int, default=None, help="clip width (default 832; smoke 64)")
    p.add_argument("--height", type=int, default=None, help="clip height (default 480; smoke 32)")
    p.add_argument("--frames", type=int, default=None, help="clip frames, 4k+1 (default 33; smoke 5)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps per clip (default 50; smoke 2)")
    p.add_argument("--step-runs", type=int, default=None, help="timed DiT steps per variant, median (default 10)")
    p.add_argument("--clip-runs", type=int, default=None, help="timed clips per side (default 1)")
    p.add_argument("--no-compile", action="store_true", help="eager DiTs only; no compiled pipeline")
    p.add_argument("--attention-backend", choices=("sdpa", "cudnn"), default="sdpa",
                   help="ours' DiT attention (model_kwargs.attention_backend)")
    p.add_argument("--runtime-compile", action="store_true", help="model_kwargs.compile=true for ours' clips")
    p.add_argument("--vae-compile", action="store_true", help="model_kwargs.vae_compile=true for ours' clips")
    p.add_argument("--fused-kernels", action="store_true",
                   help="model_kwargs.fused_kernels=true for ours' clips and compiled DiT steps (the VAE's norms as "
                        "Triton kernels, the FFN's GELU as a cuBLASLt epilogue)")
    p.add_argument("--vae-dtype", default="float32",
                   help="ours' VAE dtype (model_kwargs.vae_dtype), or a comma list (one deployment each: "
                        "float32,bfloat16); the baseline's stays float32")
    p.add_argument("--vae-contiguous", action="store_true",
                   help="model_kwargs.vae_channels_last=false (ours' VAE activations contiguous, as before)")
    p.add_argument("--skip-dit", action="store_true", help="do not time DiT steps")
    p.add_argument("--skip-clips", action="store_true", help="do not time whole clips")
    p.add_argument("--skip-eager-pipeline", action="store_true", help="no eager WanPipeline clip")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(args)
    started = time.perf_counter()
    log.info("S8 settings: %s (%d DiT tokens)", settings.describe(), settings.tokens)
    rates = {"bf16": measure_matmul_tflops(settings.device, settings.dtype), "fp32": tf32_tflops(settings.device)}
    flops = {"dit_step": {n: dit_step_flops(settings.dit, settings.tokens, TEXT_TOKENS, n)
                          for n in {*settings.batches, 2}},
             "text_encoder": text_encoder_flops(settings), "vae_decode": vae_decode_flops(settings)}
    log.info("measured %.1f TFLOP/s bf16, %.1f fp32; DiT step %.1f TFLOP per row, UMT5 %.2f, VAE decode %.2f",
             rates["bf16"], rates["fp32"], flops["dit_step"][2] / 2e12, flops["text_encoder"] / 1e12,
             flops["vae_decode"] / 1e12)

    dit = ours = None
    ours_more: dict[str, dict] = {}
    pipelines: dict[str, dict] = {}
    errors: dict[str, str] = {}
    if not args.skip_dit:
        dit = run_dit(settings)
    if not args.skip_clips:
        with tempfile.TemporaryDirectory(prefix="s8-wan-") as tmp:
            model_dir = wan_dir(Path(tmp) / "model", settings)
            dtypes = settings.vae_dtype.split(",")
            ours = run_ours(settings, model_dir, dtypes[0])
            ours_more = {dtype: run_ours(settings, model_dir, dtype) for dtype in dtypes[1:]}
            kinds = ([] if args.skip_eager_pipeline else ["eager"]) + (["compiled"] if settings.compile else [])
            for kind in kinds:
                try:
                    pipelines[kind] = run_pipeline(settings, model_dir, compiled=kind == "compiled")
                except Exception as err:  # keep ours' numbers when the baseline cannot run
                    log.exception("the %s WanPipeline baseline failed", kind)
                    errors[f"{kind} pipeline"] = f"{type(err).__name__}: {err}"
                    pipelines[kind] = {}

    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"matmul_tflops": rates, "dit_tokens": settings.tokens, "text_tokens": TEXT_TOKENS,
                     "flops": {k: ({str(n): f for n, f in v.items()} if isinstance(v, dict) else v)
                               for k, v in flops.items()}},
        "metrics": metrics_from(settings, rates, flops, dit, ours, pipelines, ours_more),
        "dit": None if dit is None else {k: ({str(n): x for n, x in v.items()} if isinstance(v, dict) else v)
                                         for k, v in dit.items()},
        "clips": {"ours": ours, **{f"ours_vae_{k}": v for k, v in ours_more.items()}, **pipelines},
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S8 done in %.1f s", record["total_s"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
