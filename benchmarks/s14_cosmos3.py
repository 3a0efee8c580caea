"""S14: Cosmos3-Nano on one GPU: the t2v DiT step and a whole clip against diffusers, and the
DROID policy's action chunks per second.

Nano's shapes (``Cosmos3OmniTransformer``'s defaults, the layout of ``nvidia/Cosmos3-Nano``'s
``transformer/config.json``): 36 layers, hidden 4096, 32 query heads and 8 K/V heads of 128,
MLP 12288 (gated SiLU), two experts a layer (text and generation), 48 latent channels in
2 x 2 patches, vocab 151936; the Wan2.2 VAE (z 48, base 160, decoder base 256, 16x spatial,
4x temporal). Dummy (seeded random) weights, bf16, one GPU.

* **dit_step**: one denoise forward at the pipeline's default t2v clip (189 frames at
  720x1280: latents [48, 48, 45, 80], 44,160 media tokens), 1 and 2 rows (the guided pair).
  Ours: ``Cosmos3Transformer`` with the prompt's text K/V computed once and reused (as the
  served Loop does). Baseline: diffusers' ``Cosmos3OmniTransformer`` holding the same weights,
  its inputs packed by the pipeline's own helpers; its two rows are two calls (the pipeline
  runs the prompt and the negative prompt as separate forwards). Eager, and with
  ``--compile`` both modules under ``torch.compile`` too. rel_err of row 0 is recorded.
* **clip**: an in-process ``cosmos3`` deployment (``load_format: dummy``; t2v at the default
  size, 35 steps, guidance 6) against ``Cosmos3OmniPipeline`` in the same process (text
  encoding, denoise, VAE decode), seconds per clip; ``--steps`` shortens both.
* **policy**: an in-process ``cosmos3_droid`` deployment: chunks and actions per second at 1 and
  16 concurrent observations (4 steps, guidance 3, chunks of 32 actions). Baseline at 1 only:
  the pipeline's policy call (``action=CosmosActionCondition(mode="policy")``, its own dummy
  weights) on the same observation, the whole call timed (it also decodes the predicted clip).

Floors: a forward's FLOPs (2 per multiply-add of the generation expert's matrices over the media
tokens, plus attention over text + media) at the measured bf16 matmul rate, or its weights read
once at the measured bandwidth, whichever is longer; a clip or a chunk is its steps' forwards
(x2 when guided). At Nano's shapes a pathway holds 6.95 B parameters (15.2 B in all) and one
t2v row's forward is 1.77 PFLOP, so a 35-step guided clip is minutes a side: the clip part takes
one warm-up clip and ``--clip-runs`` (1) timed clips each, and ``--steps`` shortens both sides.
The VAE and text encoding are left out of the clip floor (noted).

Each part runs on its own: one failing records its error and the others still run.
``--smoke`` runs every part with tiny shapes in float32 on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    Metric,
    add_run_args,
    free_device,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    record_parts,
    setup_logging,
    synchronize,
    time_calls,
)

NAME = "s14_cosmos3"
SCENARIO = "S14 cosmos3"
PROMPT = "A robot arm stacks three wooden blocks on a sunlit table, slow camera pan."
log = logging.getLogger("s14")

NANO: dict[str, Any] = {}  # Cosmos3OmniTransformer's defaults are Nano's released shapes
NANO_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                attn_scales=[], temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                out_channels=12, patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
                latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
CLIP = {"num_frames": 189, "height": 720, "width": 1280}  # the pipeline's default t2v clip
TINY = dict(head_dim=16, hidden_size=32, intermediate_size=48, latent_channel=4, latent_patch_size=2,
            num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16,
            rope_theta=10000.0, rope_axes_dim=[4, 2, 2], unified_3d_mrope_temporal_modality_margin=50)
TINY_VAE = dict(base_dim=4, decoder_base_dim=6, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
                latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
TINY_CLIP = {"num_frames": 9, "height": 48, "width": 32}
SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "flow_shift": 3.0, "num_train_timesteps": 1000,
             "prediction_type": "flow_prediction", "use_flow_sigmas": True, "solver_order": 2,
             "solver_type": "bh2", "predict_x0": True, "lower_order_final": True, "final_sigmas_type": "zero",
             "timestep_spacing": "linspace", "disable_corrector": []}
MODEL_INDEX = {"_class_name": "Cosmos3OmniPipeline", "default_use_system_prompt": True,
               "enable_safety_checker": False, "use_native_flow_schedule": False,
               "scheduler": ["diffusers", "UniPCMultistepScheduler"],
               "text_tokenizer": ["transformers", "Qwen2Tokenizer"],
               "transformer": ["diffusers", "Cosmos3OmniTransformer"], "vae": ["diffusers", "AutoencoderKLWan"]}
CHAT_TEMPLATE = ("{%- for message in messages %}"
                 "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
PARTS = ("dit_step", "clip", "policy")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, float32, CPU")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ", ".join(PARTS))
    p.add_argument("--compile", action="store_true", help="add compiled DiT-step rows (both sides)")
    p.add_argument("--steps", type=int, default=None, help="clip denoise steps (default 35; smoke 2)")
    p.add_argument("--runs", type=int, default=None, help="timed repeats (default 3; smoke 1)")
    p.add_argument("--clip-runs", type=int, default=1, help="timed clips a side after one warm-up clip")
    p.add_argument("--batches", default=None, help="policy observations at once (default 1,16; smoke 1,2)")
    add_run_args(p)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ pieces
def tower_kwargs(args) -> dict[str, Any]:
    return dict(TINY) if args.smoke else dict(NANO)


def vocab_size(args, tok) -> int:
    return len(tok) if args.smoke else 151936  # Nano's embedding table; the prompt's ids are the bytes'


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Seeded dummy weights: norms near 1, vectors small, matrices scaled by 1/sqrt(fan_in)."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * noise)
            else:
                p.copy_(noise / max(1, p[0].numel()) ** 0.5)


def make_tokenizer():
    """A byte-level Qwen2 tokenizer (the 256 byte symbols, Qwen's specials, ``<|vision_start|>``)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_tokens([*specials[1:], "<|vision_start|>"], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_checkpoint(root: Path, tower_cfg: dict[str, Any], vae_cfg: dict[str, Any], tok) -> None:
    """The pipeline's layout without weights (the deployment loads ``load_format: dummy``)."""
    tok.save_pretrained(root / "text_tokenizer")
    parts = (("transformer", tower_cfg, "Cosmos3OmniTransformer"), ("vae", vae_cfg, "AutoencoderKLWan"))
    for folder, cfg, cls in parts:
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "config.json").write_text(json.dumps({"_class_name": cls, **cfg}))
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX))


def build_reference(kwargs: dict[str, Any], device, dtype):
    from diffusers import Cosmos3OmniTransformer

    # Built on the meta device and given empty storage in ``dtype`` on the device (every
    # parameter is drawn below), so no float32 copy of the tower is ever held (61 GB at Nano's
    # shapes: with ours' clip deployment just freed, more than an H100 held). Its one buffer,
    # the rotary table, is computed for real (in float32, then cast, as a float32 build would).
    with torch.device("meta"):
        ref = Cosmos3OmniTransformer(**kwargs)
    ref = ref.to(dtype).to_empty(device=device).eval()  # cast on meta: to_empty keeps each dtype
    config = ref.config
    with torch.device(device):
        ref.rotary_emb = type(ref.rotary_emb)(head_dim=config.head_dim, rope_theta=config.rope_theta,
                                              rope_axes_dim=config.rope_axes_dim).to(dtype)
    randomize(ref, 0)
    return ref


def forward_cost(config, media: int, text: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one row's forward: the generation expert's matrices over the media tokens,
    attention over text + media, the expert's weights read once (bf16)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    flops = 2 * per_layer * layers * media + 4 * layers * q * media * (media + text)
    return float(flops), float(per_layer * layers * 2)


def floor_s(flops: float, nbytes: float, bandwidth: float, tflops: float) -> float:
    return max(flops / (tflops * 1e12), nbytes / (bandwidth * 1e9))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------ DiT step
def dit_rows(args, device, dtype, bandwidth, tflops) -> list[Metric]:
    from diffusers import Cosmos3OmniPipeline

    from mstar.layers.rotary import MRotaryEmbedding
    from mstar.model.cosmos3.config import Cosmos3Config
    from mstar.model.cosmos3.layout import media_offset, patch_grid, text_positions, video_positions
    from mstar.model.cosmos3.transformer import Cosmos3Transformer, MediaItem

    tok = make_tokenizer()
    kwargs = {**tower_kwargs(args), "vocab_size": vocab_size(args, tok)}
    ref = build_reference(kwargs, device, dtype)
    # Ours takes the reference's tensors as its parameters (no second copy of the weights: an
    # H100 holds the part); only its rotary tables, plain tensors, are built for real.
    config = Cosmos3Config.from_dict(dict(ref.config))
    with torch.device("meta"):
        ours = Cosmos3Transformer(config)
    with torch.device(device):
        ours.rope = MRotaryEmbedding(config.head_dim, config.rope_theta, list(config.rope_axes_dim))
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    ours.eval()
    clip = TINY_CLIP if args.smoke else CLIP
    frames = 1 + (clip["num_frames"] - 1) // 4
    latents = torch.randn(config.latent_channel, frames, clip["height"] // 16, clip["width"] // 16,
                          generator=torch.Generator().manual_seed(args.seed)).to(device, dtype)
    ids = torch.tensor(tok(PROMPT)["input_ids"] * (1 if args.smoke else 4), device=device)
    fps, timestep, noisy = 24.0, 500.0, list(range(frames))

    host = SimpleNamespace(transformer=ref, vae_scale_factor_temporal=4)
    text = Cosmos3OmniPipeline._prepare_text_segment(host, ids.tolist(), device=device)
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        host, latents[None], has_image_condition=False, mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=fps, curr=text["und_len"], device=device, condition_frame_indexes=[])

    def theirs_call(module):
        return module(input_ids=text["input_ids"], text_indexes=text["text_indexes"],
                      position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
                      und_len=text["und_len"], sequence_length=text["und_len"] + vision["num_vision_tokens"],
                      vision_tokens=[latents[None]], vision_token_shapes=vision["vision_token_shapes"],
                      vision_sequence_indexes=vision["vision_sequence_indexes"],
                      vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
                      vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), timestep, device=device),
                      vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"], return_dict=False)[0][0][0]

    with torch.no_grad():
        kv = ours.encode_text(ids, text_positions(config, len(ids)).to(device))
        positions = video_positions(config, patch_grid(config, latents.shape), media_offset(config, len(ids)), fps)
        item = MediaItem(latents, timestep, noisy, positions.to(device), kv)
        media = int(vision["num_vision_tokens"])
        flops, nbytes = forward_cost(config, media, len(ids))
        variants = [("eager", ours, ref)]
        if args.compile:
            variants.append(("compile", torch.compile(ours), torch.compile(ref)))
        rows: list[Metric] = []
        for variant, o, t in variants:
            err = rel_err(o([item])[0], theirs_call(t))
            for n in (1, 2):
                mine = statistics.median(time_calls(lambda o=o, n=n: o([item] * n), device, args.runs))
                base = statistics.median(time_calls(lambda t=t, n=n: [theirs_call(t) for _ in range(n)], device,
                                                    args.runs))
                floor = n * floor_s(flops, nbytes / n, bandwidth, tflops)
                rows.append(Metric(SCENARIO, f"dit_step@{n} {variant}", "ms", "lower", mine * 1e3, base * 1e3,
                                   floor * 1e3, {"rel_err_row0": err, "media_tokens": media, "text_tokens": len(ids),
                                                 "latents": list(latents.shape), "flops": n * flops,
                                                 "weight_bytes": nbytes}))
    del ours, ref
    free_device(device)
    return rows


# ------------------------------------------------------------------------------ deployments
def start_deployment(model: str, root: Path, args, device, dtype, kwargs: dict[str, Any]):
    from mstar.config import parse_config
    from mstar.runtime.launch import start

    cfg = {"model": model, "model_path": str(root), "load_format": "dummy", "max_concurrent_requests": 16,
           "model_kwargs": kwargs}
    if not args.smoke:
        cfg.update(device="cuda", dtype="bfloat16")
    return start(parse_config(cfg), in_process=True)


async def _generate(d, request_id: str, files, modalities, params) -> float:
    from mstar.contract import GenerateSpec

    t0 = time.perf_counter()
    async for event in d.backend.generate(GenerateSpec(request_id, PROMPT, files, modalities, params)):
        if event.error:
            raise RuntimeError(event.error)
    return time.perf_counter() - t0


def run_batch(d, tag: str, n: int, files, modalities, params) -> float:
    async def go():
        t0 = time.perf_counter()
        await asyncio.gather(*(_generate(d, f"{tag}-{i}", files, modalities, params) for i in range(n)))
        return time.perf_counter() - t0

    return asyncio.run(go())


def build_pipeline(tower_cfg, vae_cfg, tok, device, dtype):
    """``Cosmos3OmniPipeline`` over its own seeded dummy tower (bf16) and VAE (float32)."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler

    tower = build_reference(tower_cfg, device, dtype)
    with torch.device(device):
        vae = AutoencoderKLWan(**vae_cfg)
    vae = vae.float().eval()
    randomize(vae, 1)
    pipe = Cosmos3OmniPipeline(transformer=tower, text_tokenizer=tok, vae=vae,
                               scheduler=UniPCMultistepScheduler.from_config(SCHEDULER), enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def time_pipeline(call, device, runs: int) -> float:
    """Seconds a call, the median of ``runs`` after one warm-up call (wall clock, synchronised)."""
    with torch.no_grad():
        call()
        synchronize(device)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            call()
            synchronize(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def clip_rows(args, device, dtype, bandwidth, tflops) -> list[Metric]:
    from mstar.model.cosmos3.config import Cosmos3Config

    steps = args.steps or (2 if args.smoke else 35)
    clip = TINY_CLIP if args.smoke else CLIP
    tok = make_tokenizer()
    tower_cfg = {**tower_kwargs(args), "vocab_size": vocab_size(args, tok)}
    vae_cfg = TINY_VAE if args.smoke else NANO_VAE
    notes: dict[str, Any] = {"steps": steps, "guidance": 6.0, **clip}
    ours = base = None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_checkpoint(root, tower_cfg, vae_cfg, tok)
        d = start_deployment("cosmos3", root, args, device, dtype,
                             {"num_inference_steps": steps, "guidance_scale": 6.0, "vae_dtype": "float32",
                              "max_video_pixels": clip["height"] * clip["width"] * clip["num_frames"]})
        try:
            params = {**clip, "num_inference_steps": steps, "guidance_scale": 6.0, "seed": args.seed}
            run_batch(d, "clip-warm", 1, [], ["video"], params)
            ours = statistics.median(run_batch(d, f"clip-{r}", 1, [], ["video"], params)
                                     for r in range(args.clip_runs))
        finally:
            d.close()
            free_device(device)
    try:
        pipe = build_pipeline(tower_cfg, vae_cfg, tok, device, dtype)

        def call():
            return pipe(PROMPT, num_inference_steps=steps, guidance_scale=6.0, output_type="np",
                        generator=torch.Generator(device=device).manual_seed(args.seed),
                        enable_safety_check=False, **clip)

        try:
            base = time_pipeline(call, device, args.clip_runs)
        except torch.OutOfMemoryError:
            base = None  # retried below, once the failed call's frames (and tensors) are gone
        if base is None:
            # the whole clip's float32 decode beside the resident tower outgrows an 80 GB card
            # (H100, 2026-12-07): diffusers' own answer is the VAE's tiled decode
            free_device(device)
            pipe.vae.enable_tiling()
            notes["baseline_vae"] = "tiled decode (the whole-clip decode ran out of memory)"
            base = time_pipeline(call, device, args.clip_runs)
        free_device(device)
    except Exception as err:  # the baseline failing keeps ours' row
        log.exception("clip baseline failed")
        notes["baseline_error"] = f"{type(err).__name__}: {err}"
    config = Cosmos3Config.from_dict(tower_cfg)
    frames = 1 + (clip["num_frames"] - 1) // 4
    media = frames * -(-clip["height"] // 32) * -(-clip["width"] // 32)
    flops, nbytes = forward_cost(config, media, 64)
    floor = steps * 2 * floor_s(flops, nbytes / 2, bandwidth, tflops)
    notes["floor"] = "the tower's guided forwards only (text encoding and VAE decode left out)"
    return [Metric(SCENARIO, "clip t2v", "s", "lower", ours, base, floor, notes)]


def observation_png(size: int) -> bytes:
    from PIL import Image

    gen = torch.Generator().manual_seed(3)
    pixels = (torch.rand(size, size, 3, generator=gen) * 255).byte().numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def policy_rows(args, device, dtype, bandwidth, tflops) -> list[Metric]:
    from mstar.model.cosmos3.config import Cosmos3Config

    chunk = 4 if args.smoke else 32
    batches = [int(b) for b in (args.batches or ("1,2" if args.smoke else "1,16")).split(",")]
    tok = make_tokenizer()
    heads = {"action_gen": True, "action_dim": 12 if args.smoke else 32,
             "num_embodiment_domains": 10 if args.smoke else 32}
    tower_cfg = {**tower_kwargs(args), "vocab_size": vocab_size(args, tok), **heads}
    vae_cfg = TINY_VAE if args.smoke else NANO_VAE
    tier, size = 256, 64 if args.smoke else 320
    rows: list[Metric] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_checkpoint(root, tower_cfg, vae_cfg, tok)
        d = start_deployment("cosmos3_droid", root, args, device, dtype,
                             {"num_inference_steps": 4, "guidance_scale": 3.0, "domain_name": "droid_lerobot",
                              "action_chunk_size": chunk, "vae_dtype": "float32"})
        try:
            files = [("image", observation_png(size))]
            params = {"resolution_tier": tier, "seed": args.seed}
            run_batch(d, "policy-warm", max(batches), files, ["action"], params)
            config = Cosmos3Config.from_dict(tower_cfg)
            media = (1 + chunk // 4) * (tier // 32) ** 2 + chunk
            flops, nbytes = forward_cost(config, media, 64)
            for n in batches:
                wall = statistics.median(run_batch(d, f"policy{n}-{r}", n, files, ["action"], params)
                                         for r in range(args.runs))
                floor = 4 * floor_s(2 * n * flops, nbytes, bandwidth, tflops)
                notes = {"observations": n, "steps": 4, "guidance": 3.0, "chunk": chunk, "wall_s": wall,
                         "floor_tokens_per_row": media}
                rows.append(Metric(SCENARIO, f"chunks/s@{n}", "chunk/s", "higher", n / wall, None, n / floor, notes))
                rows.append(Metric(SCENARIO, f"actions/s@{n}", "action/s", "higher", n * chunk / wall, None,
                                   n * chunk / floor, notes))
        finally:
            d.close()
            free_device(device)
    baseline_at_1(args, rows, tower_cfg, vae_cfg, tok, device, dtype, chunk, tier, size)
    return rows


def baseline_at_1(args, rows, tower_cfg, vae_cfg, tok, device, dtype, chunk, tier, size) -> None:
    """The pipeline's policy call (``action=CosmosActionCondition``) on one observation fills the
    baseline column of the ``@1`` rows; an error is noted there instead."""
    from PIL import Image

    at_1 = [r for r in rows if r.metric.endswith("@1")]
    if not at_1:
        return
    try:
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

        pipe = build_pipeline(tower_cfg, vae_cfg, tok, device, dtype)
        image = Image.open(io.BytesIO(observation_png(size))).convert("RGB")
        condition = CosmosActionCondition(mode="policy", chunk_size=chunk, domain_name="droid_lerobot",
                                          resolution_tier=tier, image=image)
        seconds = time_pipeline(lambda: pipe(prompt=PROMPT, negative_prompt="", action=condition,
                                             num_inference_steps=4, guidance_scale=3.0, output_type="np",
                                             generator=torch.Generator(device=device).manual_seed(args.seed)),
                                device, args.runs)
        free_device(device)
        for row in at_1:
            row.baseline = (1 if row.metric.startswith("chunks") else chunk) / seconds
    except Exception as err:  # ours' rows stand without it
        log.exception("policy baseline failed")
        for row in at_1:
            row.notes["baseline_error"] = f"{type(err).__name__}: {err}"


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("S14 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
    args.runs = args.runs or (1 if args.smoke else 3)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(args.seed)
    bandwidth = measure_memory_bandwidth(device, 32 * 2**20 if args.smoke else None)
    tflops = measure_matmul_tflops(device, dtype, 256 if args.smoke else None)
    parts = {"dit_step": dit_rows, "clip": clip_rows, "policy": policy_rows}
    return record_parts(NAME, parts, args, device, dtype, bandwidth, tflops)


if __name__ == "__main__":
    sys.exit(main())
