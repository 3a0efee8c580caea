"""S8's parts outside the denoising steps, and where a compiled DiT step goes.

A whole S8 clip (``s8_wan22.py``) is UMT5 twice, 50 guided DiT steps and one VAE decode; this
times the parts on their own so the clip's time can be split:

* **VAE decode** of S8's latents ``[1, 48, 9, 30, 52]`` to uint8 frames on the host: ours
  (``mstar.model.wan22.vae.WanVAE``) against diffusers' ``AutoencoderKLWan`` holding the same
  weights, float32 as the model card loads it; ours one latent frame at a time (as diffusers)
  and in chunks, eager and with the fused norm kernels (``fused_kernels``), and in bfloat16
  (with its largest difference from float32 in uint8 levels).
* **UMT5-XXL** over 512 tokens, two prompts: ours against transformers' ``UMT5EncoderModel``.
* **DiT step profile**: ours with every block compiled, two rows (a guided pair), the CUDA
  kernels' time summed by kind (matrix products, attention, compiled element-wise, other).

``--smoke`` runs the code paths with S8's tiny configs on the CPU.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import add_run_args, hardware, setup_logging, synchronize, time_calls, write_record
from benchmarks.s8_wan22 import TEXT_TOKENS, build_dits, dit_inputs, settings_from
from benchmarks.s8_wan22 import parse_args as s8_args

NAME = "s8_parts"
log = logging.getLogger("s8_parts")


def frames_of_theirs(video: torch.Tensor) -> torch.Tensor:
    """diffusers' decoded ``[1, 3, F, H, W]`` in ``[-1, 1]`` to uint8 ``[F, H, W, 3]`` on the host
    (what the pipeline's ``postprocess_video`` then does in numpy, kept on the GPU here)."""
    from mstar.model.wan22.vae import frames_uint8

    return frames_uint8(video[0]).cpu()


def time_vae(settings, runs: int) -> dict[str, Any]:
    from diffusers import AutoencoderKLWan

    from mstar.model.wan22.vae import (
        DECODE_CHUNK,
        Upsample,
        WanVAE,
        WanVAEConfig,
        frames_uint8,
        use_channels_last,
        use_fused_kernels,
    )
    from mstar.model.weights import init_dummy_weights

    device = torch.device(settings.device)
    with torch.device(device):
        ours = WanVAE(WanVAEConfig.from_dict(settings.vae)).eval()
        theirs = AutoencoderKLWan(**settings.vae).eval()
    init_dummy_weights(ours, seed=settings.seed)
    missing = theirs.load_state_dict(ours.state_dict(), strict=False)
    log.info("VAE: diffusers keys not in ours: %s", missing)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    z = torch.randn(1, *settings.latent_shape, device=device, generator=generator)

    def ours_decode(model, dtype, chunk=DECODE_CHUNK):
        x = z.to(dtype)
        return lambda: frames_uint8(model.decode(x, chunk=chunk)[0]).cpu()

    def theirs_decode():
        return frames_of_theirs(theirs.decode(z).sample)

    out: dict[str, Any] = {}
    with torch.inference_mode():
        reference = ours_decode(ours, torch.float32)()
        out["ours_vs_diffusers_levels"] = int((reference.int() - theirs_decode().int()).abs().max())

        def timed(label, fn):
            times = time_calls(fn, device, runs, warmup=1)
            out[label] = statistics.median(times)
            log.info("VAE decode %s: %.3f s (runs %s)", label, out[label], ", ".join(f"{t:.3f}" for t in times))

        timed("diffusers_fp32", theirs_decode)
        timed("ours_fp32_chunk1", ours_decode(ours, torch.float32, chunk=1))
        timed("ours_fp32", ours_decode(ours, torch.float32))
        fuse = device.type == "cuda"  # the kernels need CUDA (or the interpreter)
        use_fused_kernels(ours, fuse)
        fused = ours_decode(ours, torch.float32)()
        out["fused_levels_max"] = int((fused.int() - reference.int()).abs().max())
        timed("ours_fp32_fused", ours_decode(ours, torch.float32))
        upsamplers = [m for m in ours.modules() if isinstance(m, Upsample)]
        for m in upsamplers:  # the upsamplers' convolutions on the doubled frames, as before
            m.fused = False
        timed("ours_fp32_fused_norms_only", ours_decode(ours, torch.float32))
        for m in upsamplers:
            m.fused = fuse
        if device.type == "cuda":  # activations channels-last (cuDNN's native layout), as the engine runs it
            use_channels_last(ours)
            last = frames_uint8(ours.decode(z)[0]).cpu()
            out["channels_last_levels_max"] = int((last.int() - reference.int()).abs().max())
            timed("ours_fp32_fused_channels_last", ours_decode(ours, torch.float32))
            out["profile_ours_fp32_fused_channels_last"] = kernel_table(ours_decode(ours, torch.float32), 25)
            use_channels_last(ours, False)
        bf16 = WanVAE(WanVAEConfig.from_dict(settings.vae)).to(device, torch.bfloat16).eval()
        bf16.load_state_dict(ours.state_dict())
        use_fused_kernels(bf16, fuse)
        frames = ours_decode(bf16, torch.bfloat16)()
        diff = (frames.int() - reference.int()).abs()
        out["bf16_levels_max"], out["bf16_levels_mean"] = int(diff.max()), float(diff.float().mean())
        log.info("VAE: uint8 levels from ours fp32: diffusers %d, fused %d, bf16 max %d mean %.3f",
                 out["ours_vs_diffusers_levels"], out["fused_levels_max"], out["bf16_levels_max"],
                 out["bf16_levels_mean"])
        timed("ours_bf16_fused", ours_decode(bf16, torch.bfloat16))
        if device.type == "cuda":
            out["profile_ours_fp32_fused"] = kernel_table(ours_decode(ours, torch.float32), 25)
    return out


def time_umt5(settings, runs: int) -> dict[str, Any]:
    from transformers import UMT5Config as HFConfig
    from transformers import UMT5EncoderModel

    from mstar.model.wan22.umt5 import UMT5Config, UMT5Encoder
    from mstar.model.weights import init_dummy_weights

    device = torch.device(settings.device)
    with torch.device(device):
        ours = UMT5Encoder(UMT5Config.from_dict(settings.text)).to(settings.dtype).eval()
    init_dummy_weights(ours, seed=settings.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(settings.dtype)
    try:
        with torch.device(device):
            theirs = UMT5EncoderModel(HFConfig(**settings.text)).eval()
    finally:
        torch.set_default_dtype(default)
    ids = torch.randint(3, settings.text["vocab_size"], (2, TEXT_TOKENS), device=device)
    mask = torch.ones_like(ids)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for label, fn in (("ours", lambda: ours(ids, mask)), ("transformers", lambda: theirs(ids, mask))):
            times = time_calls(fn, device, runs, warmup=1)
            out[label] = statistics.median(times)
            log.info("UMT5, 2 prompts: %s %.1f ms", label, out[label] * 1e3)
    return out


KINDS = (("attention", ("flash", "fmha", "attention", "cudnn")), ("matmul", ("gemm", "sm90", "nvjet", "cutlass",
                                                                          "xmma", "splitk")),
         ("compiled", ("triton_",)))


def kernel_table(fn, top: int) -> dict[str, Any]:
    """CUDA kernels of one ``fn()`` under torch's profiler: time by kind and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(torch.device("cuda"))
    kinds: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        us = event.self_device_time_total
        if us <= 0:
            continue
        name = event.key.lower()
        kind = next((k for k, marks in KINDS if any(m in name for m in marks)), "other")
        kinds[kind] += us / 1e3
        kernels.append((us / 1e3, event.count, event.key[:120]))
    kernels.sort(reverse=True)
    for ms, count, key in kernels[:top]:
        log.info("  %9.2f ms %5d  %s", ms, count, key)
    log.info("  by kind (ms): %s", {k: round(v, 2) for k, v in kinds.items()})
    return {"by_kind_ms": dict(kinds), "top": kernels[:top]}


def profile_dit(settings) -> dict[str, Any]:
    ours, theirs = build_dits(settings)
    del theirs
    for block in ours.blocks:
        block.compile(dynamic=False, backend=settings.compile_backend)
    inputs = dit_inputs(settings, 2)
    with torch.inference_mode():
        t0 = time.perf_counter()
        ours(inputs["latents"], inputs["t"], inputs["text"])
        synchronize(torch.device(settings.device))
        compile_s = time.perf_counter() - t0
        times = time_calls(lambda: ours(inputs["latents"], inputs["t"], inputs["text"]), settings.device, 5)
        log.info("DiT compiled, 2 rows: %.1f ms (compile %.0f s)", statistics.median(times) * 1e3, compile_s)
        table = kernel_table(lambda: ours(inputs["latents"], inputs["t"], inputs["text"]), 30) \
            if settings.device == "cuda" else {}
    return {"ms": statistics.median(times) * 1e3, "compile_s": compile_s, **table}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--skip", default="", help="comma list of parts to skip: vae, umt5, dit")
    add_run_args(p)
    args = p.parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(s8_args(["--smoke"] if args.smoke else []))
    skip = set(filter(None, args.skip.split(",")))
    record: dict[str, Any] = {"scenario": "S8 parts", "hardware": hardware(), "settings": settings.describe()}
    if "vae" not in skip:
        record["vae"] = time_vae(settings, args.runs)
        torch.cuda.empty_cache() if settings.device == "cuda" else None
    if "umt5" not in skip:
        record["umt5"] = time_umt5(settings, args.runs)
        torch.cuda.empty_cache() if settings.device == "cuda" else None
    if "dit" not in skip:
        record["dit"] = profile_dit(settings)
    write_record(NAME, record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
