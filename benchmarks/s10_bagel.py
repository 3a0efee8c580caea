"""S10: BAGEL-7B-MoT image generation (1024², 50 steps, CFG) and a 1-image chat, against bagel2.

BAGEL-7B-MoT shapes (Qwen2-7B MoT LLM: 28 layers, hidden 3584, 28 heads over 4 KV heads, FFN
18944, vocab 152064, an understanding and a generation copy of every layer's weights; SigLIP
so400m NaViT, 26 layers read, patches of 14; FLUX.1's VAE), random ("dummy") weights, bf16 on
one GPU.

* **ours**: an in-process M* deployment of ``bagel`` (``load_format: dummy``):
  - ``image@1``: one text-to-image request (1024 x 1024, 50 schedule points, BAGEL's default
    guidance: text 4 on ``0.4 < t <= 1``, image 1.5), seconds per image, PNG included;
  - ``images@4``: 4 such requests at once, images per second;
  - ``chat``: one chat with one 512 x 512 image, ``--chat-tokens`` new tokens, EOS ignored:
    time to first token and ms per output token after the first.
* **baseline**: bagel2's ``Bagel`` and ``AutoEncoder`` (the official inference code) in the same
  process, holding the same weights: ours' dummy weights are drawn again from the same seeds and
  copied in under the released names (coverage both ways). Images through
  ``InterleaveInferencer.interleave_inference`` with the same guidance; 4 images one after the
  other (the reference has no batching across requests). The chat through the inferencer's
  context updates (the image's ViT tokens, the text) and ``Bagel.generate_text`` (EOS ignored).
  Its attention is flash-attn's ``flash_attn_varlen_func`` when ``flash_attn`` imports, else the
  SDPA stand-in of ``tests/support/bagel_reference.py``; the record says which.
* **floor**: per denoise step, the larger of its FLOPs (the latent tokens of every CFG variant
  through the generation weights, plus attention over each context and the image itself) at
  the measured bf16 matmul rate and one read of the generation weights at the measured copy
  bandwidth; a text-to-image request needs 2 variants while guidance is on (its "without the
  image" context is the full one) and 1 otherwise. Prompt contexts and the VAE decode are left
  out. The chat: the prompt's FLOPs for the first token, one read of the understanding weights
  per token after it.

``--smoke`` runs the same code paths with a tiny model on the CPU in seconds.
See benchmarks/README.md and docs/bagel-generation.md for the command lines.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    Metric,
    add_run_args,
    free_device,
    hardware,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    setup_logging,
    synchronize,
    write_record,
)

NAME = "s10_bagel"
SCENARIO = "S10 bagel-7B-MoT"
PROMPT = "a red fox trotting through fresh snow at dawn"
QUESTION = "what is in this picture"
# BAGEL's text-to-image defaults (ours: docs/bagel-generation.md; the demo's values)
CFG = dict(cfg_text_scale=4.0, cfg_img_scale=1.5, cfg_interval=[0.4, 1.0], timestep_shift=3.0,
           cfg_renorm_min=1.0, cfg_renorm_type="global")

log = logging.getLogger("s10")

# BAGEL-7B-MoT's llm_config.json (Qwen2-7B-Instruct with MoT layers), vit_config.json (SigLIP
# so400m; the file counts 27 layers, BAGEL reads 26) and config.json.
LLM_7B: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "qk_norm": True, "layer_module": "Qwen2MoTDecoderLayer",
    "pad_token_id": None,
}
VIT_SO400M: dict[str, Any] = {
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26, "num_attention_heads": 16,
    "num_channels": 3, "image_size": 980, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6, "rope": False,
}
TOP_7B: dict[str, Any] = {"vit_max_num_patch_per_side": 70, "latent_patch_size": 2, "max_latent_size": 64}
AE_FLUX1: dict[str, Any] = {  # BAGEL's load_ae: FLUX.1's autoencoder
    "resolution": 256, "in_channels": 3, "downsample": 8, "ch": 128, "out_ch": 3, "ch_mult": [1, 2, 4, 4],
    "num_res_blocks": 2, "z_channels": 16, "scale_factor": 0.3611, "shift_factor": 0.1159,
}
AE_TINY: dict[str, Any] = {**AE_FLUX1, "resolution": 32, "ch": 32, "ch_mult": [1, 1, 1, 1], "num_res_blocks": 1,
                           "z_channels": 4}


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    llm: dict[str, Any]
    vit: dict[str, Any]
    top: dict[str, Any]
    ae: dict[str, Any]
    size: int
    steps: int
    concurrent: int
    chat_image: int
    chat_tokens: int
    runs: int
    attention_backend: str
    generator_kv_pages: int
    seed: int = 0

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        out["cfg"] = CFG
        out["latent_tokens"] = self.latent_tokens
        return out

    @property
    def latent_tokens(self) -> int:
        return (self.size // (self.ae["downsample"] * self.top["latent_patch_size"])) ** 2

    @property
    def knobs(self) -> dict[str, Any]:
        """``model_kwargs`` of ours' deployment."""
        kwargs: dict[str, Any] = {"seed": self.seed, "generator_kv_pages": self.generator_kv_pages,
                                  "attention_backend": self.attention_backend}
        if self.smoke:  # the tiny tower reads up to 8 x 8 patches of 4 pixels
            kwargs.update(vit_resize=[32, 16], vae_resize=[64, 32])
        return kwargs


def settings_from(args: argparse.Namespace) -> Settings:
    if args.smoke:
        from tests.support import bagel_reference as br

        device, dtype = "cpu", torch.float32
        llm, vit, top, ae = dict(br.LLM), dict(br.VIT), {**TOP_7B, "vit_max_num_patch_per_side": 8,
                                                         "max_latent_size": 8}, AE_TINY
        size, steps, chat_image, chat_tokens, pages = args.size or 64, args.steps or 3, 32, args.chat_tokens or 32, 64
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S10 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, llm, vit, top, ae = "cuda", torch.bfloat16, LLM_7B, VIT_SO400M, TOP_7B, AE_FLUX1
        size, steps, chat_image, chat_tokens = args.size or 1024, args.steps or 50, 512, args.chat_tokens or 128
        pages = 8192  # configs/bagel.yaml's: three contexts of 4096 latent tokens (and a prompt) per request
    return Settings(smoke=args.smoke, device=device, dtype=dtype, llm=dict(llm), vit=dict(vit), top=dict(top),
                    ae=dict(ae), size=size, steps=steps, concurrent=args.concurrent, chat_image=chat_image,
                    chat_tokens=chat_tokens, runs=args.runs, attention_backend=args.attention_backend,
                    generator_kv_pages=pages, seed=args.seed)


def model_dir(root: Path, settings: Settings) -> Path:
    """A BAGEL-7B-MoT-shaped directory with no weights (``load_format: dummy``): the three
    configs and the tiny test tokenizer (its ids are below any vocabulary here); in a smoke run
    also a tiny ``ae.safetensors`` (its shapes set the VAE; dummy weights replace its values)."""
    from tests.support.bagel_tokenizer import tokenizer

    root.mkdir(parents=True, exist_ok=True)
    llm = dict(settings.llm, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    vit = dict(settings.vit, num_hidden_layers=settings.vit["num_hidden_layers"] + 1,
               model_type="siglip_vision_model")
    (root / "llm_config.json").write_text(json.dumps(llm))
    (root / "vit_config.json").write_text(json.dumps(vit))
    (root / "config.json").write_text(json.dumps(settings.top))
    tokenizer().save_pretrained(root)
    if settings.smoke:
        from safetensors.torch import save_file

        ae = reference_autoencoder(settings, torch.device("cpu"))
        save_file({k: v.contiguous() for k, v in ae.state_dict().items()}, str(root / "ae.safetensors"))
    return root


# --------------------------------------------------------------------------- the bound
def generation_weights(llm: dict[str, Any]) -> float:
    """Parameters of one forward through the generation copy of the MoT layers (projections,
    MLP; norms left out) and nothing else: what each denoise step reads."""
    d, f = llm["hidden_size"], llm["intermediate_size"]
    kv = llm["num_key_value_heads"] * d // llm["num_attention_heads"]
    return float(llm["num_hidden_layers"] * (2 * d * d + 2 * d * kv + 3 * d * f))


def step_flops(llm: dict[str, Any], tokens: int, context: int, variants: int) -> float:
    """FLOPs of one denoise step: ``variants`` queries of ``tokens + 2`` (the image between its
    start and end tokens) through the generation weights, and their attention (``QK^T`` and
    ``PV``) over a context of ``context`` tokens and over themselves (both ways)."""
    q = tokens + 2
    attention = 2 * 2 * q * (context + q) * llm["hidden_size"] * llm["num_hidden_layers"]
    return float(variants * (2 * q * generation_weights(llm) + attention))


def image_floor_s(settings: Settings, rates: dict[str, float], context: int) -> dict[str, float]:
    """The least seconds of one image's denoise loop, and of its steps had all three CFG
    variants been computed (the reference's count)."""
    from mstar.model.bagel.generation import cfg_active, timestep_schedule

    times, _ = timestep_schedule(settings.steps, CFG["timestep_shift"])
    weight_s = generation_weights(settings.llm) * settings.dtype.itemsize / (rates["bandwidth_gb_s"] * 1e9)
    total = three = 0.0
    for t in times.tolist():
        guided = cfg_active(t, tuple(CFG["cfg_interval"]))
        for variants, acc in ((2 if guided else 1, "total"), (3 if guided else 1, "three")):
            flops_s = step_flops(settings.llm, settings.latent_tokens, context, variants) / (rates["bf16"] * 1e12)
            if acc == "total":
                total += max(flops_s, weight_s)
            else:
                three += max(flops_s, weight_s)
    return {"s": total, "s_three_variants": three, "weight_read_s_per_step": weight_s}


# ---------------------------------------------------------------------------- ours
def deployment(settings: Settings, directory: Path) -> dict[str, Any]:
    return {"model": "bagel", "model_path": str(directory), "load_format": "dummy", "device": settings.device,
            "dtype": str(settings.dtype).removeprefix("torch."), "max_seq_len": 4096,
            "max_concurrent_requests": max(16, settings.concurrent),
            "resources": {"kv_cache": {"max_num_pages": 1024, "page_size": 16}},
            "model_kwargs": settings.knobs}


def png(size: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def run_ours(settings: Settings, directory: Path) -> dict[str, Any]:
    """Ours' rows through an in-process ``bagel`` deployment (a 2-step image and a short chat
    warm it up first)."""
    import mstar.model.bagel.model  # noqa: F401  (registers bagel)
    from mstar.config import parse_config
    from mstar.contract import ChatSpec, ImageSpec, SamplingParams
    from mstar.runtime.launch import start

    t0 = time.perf_counter()
    d = start(parse_config(deployment(settings, directory), "s10 config"), in_process=True)
    out: dict[str, Any] = {"startup_s": time.perf_counter() - t0}
    log.info("ours: bagel deployment ready in %.1f s", out["startup_s"])
    counter = iter(range(1 << 30))

    async def image(steps: int) -> float:
        spec = ImageSpec(f"s10-{next(counter)}", PROMPT, settings.size, settings.size, 1, settings.seed, steps)
        start_s = time.perf_counter()
        [data] = await d.backend.generate_images(spec)
        if not data.startswith(b"\x89PNG"):
            raise RuntimeError("the runtime returned no PNG")
        return time.perf_counter() - start_s

    def images(n: int, steps: int) -> float:
        async def batch() -> float:
            start_s = time.perf_counter()
            await asyncio.gather(*[image(steps) for _ in range(n)])
            return time.perf_counter() - start_s

        return asyncio.run(batch())

    picture = png(settings.chat_image, settings.seed)

    def chat(tokens: int) -> list[float]:
        """Seconds from submitting to each new token's event."""
        messages = [{"role": "user", "content": [{"type": "image", "data": picture},
                                                 {"type": "text", "text": QUESTION}]}]
        spec = ChatSpec(f"s10-{next(counter)}", messages, SamplingParams(temperature=0.0), tokens, ignore_eos=True)

        async def run() -> list[float]:
            start_s, stamps = time.perf_counter(), []
            async for event in d.backend.chat(spec):
                if event.error:
                    raise RuntimeError(event.error)
                stamps += [time.perf_counter() - start_s] * len(event.token_ids)
            return stamps

        stamps = asyncio.run(run())
        if len(stamps) != tokens:
            raise RuntimeError(f"the chat gave {len(stamps)} tokens, not {tokens}")
        return stamps

    try:
        t0 = time.perf_counter()
        images(1, 2)
        chat(2)
        out["warmup_s"] = time.perf_counter() - t0
        out["s_per_image"] = [images(1, settings.steps) for _ in range(settings.runs)]
        out[f"s_per_{settings.concurrent}_images"] = [images(settings.concurrent, settings.steps)
                                                      for _ in range(settings.runs)]
        # Per token by difference, as the baseline's: a chat of one token against a longer one.
        # Stamps within one chat can coincide (a late reader gets several tokens in one event),
        # which left (last - first) at 0 on a busy 2-core machine.
        one = [chat(1)[0] for _ in range(settings.runs)]
        runs = [chat(settings.chat_tokens) for _ in range(settings.runs)]
        out["chat_ttft_s"] = one
        out["chat_ms_per_token"] = [(r[-1] - statistics.median(one)) / max(len(r) - 1, 1) * 1e3 for r in runs]
        log.info("ours: %.2f s per image, %d at once in %.2f s; chat TTFT %.1f ms, %.2f ms/token",
                 statistics.median(out["s_per_image"]), settings.concurrent,
                 statistics.median(out[f"s_per_{settings.concurrent}_images"]),
                 statistics.median(out["chat_ttft_s"]) * 1e3, statistics.median(out["chat_ms_per_token"]))
    finally:
        d.close()
        free_device(settings.device)
    return out


# ------------------------------------------------------------------------ reference
def import_reference() -> str:
    """Make bagel2 importable (``tests.support.bagel_reference``) and say which attention it
    runs: flash-attn when it imports, else the SDPA stand-in. Called before anything else
    imports the support module, which installs the stand-in when no ``flash_attn`` is loaded."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        pass
    try:
        from tests.support import bagel_reference as br
    except ImportError as err:  # no bagel2: ours still runs, the baseline records the error
        return f"unavailable ({err})"
    module = sys.modules["flash_attn"]
    if module.flash_attn_varlen_func is br.flash_attn_varlen_func:
        return "SDPA stand-in (tests/support/bagel_reference.py)"
    return f"flash_attn {getattr(module, '__version__', '?')}"


def reference_autoencoder(settings: Settings, device: torch.device):
    from bagel2.modeling.autoencoder import AutoEncoder, AutoEncoderParams

    with torch.device(device):
        return AutoEncoder(AutoEncoderParams(**settings.ae)).eval()


def ours_released_state(settings: Settings, directory: Path, device: torch.device) -> dict[str, dict]:
    """Ours' dummy weights drawn again exactly as the deployment draws them (same seeds, same
    device), under the released names: ``ema.safetensors``' for the model, ours' for the VAE."""
    from mstar.model.bagel.checkpoint import BagelCheckpoint, BagelParts
    from mstar.model.bagel.image_engine import load_generation_side

    ckpt = BagelCheckpoint.locate(str(directory))
    model, tower = ckpt.load_models(device, settings.dtype, llm=True, vision=True, dummy=True, seed=settings.seed)
    proj, vae = load_generation_side(ckpt, ckpt.config(), device, settings.dtype, dummy=True, seed=settings.seed + 2)
    parts = BagelParts({"llm": model, "vision": tower, "generation": proj})
    return {"model": parts.state_dict(), "vae": vae.state_dict(),
            "vae_levels": len(vae.config.net.block_out_channels)}


def build_reference(settings: Settings, directory: Path, br) -> tuple[Any, Any]:
    """bagel2's ``Bagel`` and ``AutoEncoder`` in ``dtype`` on the device, holding ours' weights."""
    from mstar.model.bagel.checkpoint import FIXED_TABLES
    from mstar.model.bagel.vae import original_name

    device = torch.device(settings.device)
    # Ours' weights are drawn on the device (where the deployment draws them), kept on the
    # host while the reference is built: both at once do not fit an 80 GB card at 7B.
    ours = ours_released_state(settings, directory, device)
    ours["model"] = {k: v.cpu() for k, v in ours["model"].items()}
    ours["vae"] = {k: v.cpu() for k, v in ours["vae"].items()}
    free_device(settings.device)
    llm_config = br.Qwen2Config(**settings.llm)
    vit_config = br.SiglipVisionConfig(**settings.vit)
    config = br.BagelConfig(llm_config=llm_config, vit_config=vit_config,
                            vae_config=br.VAE.__class__(downsample=settings.ae["downsample"],
                                                        z_channels=settings.ae["z_channels"]),
                            visual_gen=True, visual_und=True, connector_act="gelu_pytorch_tanh",
                            interpolate_pos=False, timestep_shift=1.0, **settings.top)
    default = torch.get_default_dtype()
    torch.set_default_dtype(settings.dtype)
    try:
        with torch.device(device):
            model = br.Bagel(br.Qwen2ForCausalLM(llm_config), br.SiglipVisionModel(vit_config), config)
            model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    finally:
        torch.set_default_dtype(default)
    model = model.to(settings.dtype).eval()
    ae = reference_autoencoder(settings, device).to(settings.dtype)
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(ours["model"], strict=False)
        if set(missing) - FIXED_TABLES or unexpected:
            raise RuntimeError(f"weights do not cover each other: missing {sorted(missing)[:5]}, "
                               f"unexpected {sorted(unexpected)[:5]}")
        state = {k: ours["vae"][original_name(k, ours["vae_levels"])].reshape(v.shape)
                 for k, v in ae.state_dict().items()}
        ae.load_state_dict(state, strict=True)
    ours.clear()
    free_device(settings.device)
    return model, ae


class VitTransform:
    """The ViT's image transform for the reference: ours' ``preprocess`` (BAGEL's two resizes,
    sides multiples of the patch, normalised to [-1, 1]), the pixels the reference's
    ``ImageTransform`` gives; bagel2's own needs OpenCV, which the benchmark does without."""

    def __init__(self, settings: Settings) -> None:
        self.patch, self.device = settings.vit["patch_size"], torch.device(settings.device)
        self.vit_resize, self.vae_resize = ((32, 16), (64, 32)) if settings.smoke else ((980, 224), (1024, 512))

    def __call__(self, image, img_num: int = 1) -> torch.Tensor:
        from mstar.model.bagel.vision import preprocess

        return preprocess(image, self.patch, self.vit_resize, self.vae_resize).to(self.device)


def run_reference(settings: Settings, directory: Path, attention: str) -> dict[str, Any]:
    """The baseline's rows: bagel2's inferencer holding ours' weights."""
    from bagel2.inferencer import InterleaveInferencer
    from PIL import Image

    from tests.support import bagel_reference as br

    if not settings.smoke:  # bfloat16 on the GPU: bagel2's own casts, not the CPU parity view
        from bagel2.modeling.bagel import qwen2_navit, siglip_navit

        qwen2_navit.torch = siglip_navit.torch = torch
    t0 = time.perf_counter()
    model, ae = build_reference(settings, directory, br)
    held = {"model": model, "ae": ae}  # dropped in `finally`, with the closures' other references
    out: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "attention": attention}
    log.info("baseline: bagel2 built in %.1f s (%s)", out["startup_s"], attention)
    vit_transform = VitTransform(settings)
    held["inferencer"] = InterleaveInferencer(model, ae, br.tokenizer(), None, vit_transform, br.TOKENS)
    del model, ae
    device = torch.device(settings.device)

    def image(steps: int) -> float:
        synchronize(device)
        start_s = time.perf_counter()
        torch.manual_seed(settings.seed)
        with torch.device(device):  # bagel2 makes its index tensors on the default device
            [picture] = held["inferencer"].interleave_inference(
                [PROMPT], image_shapes=(settings.size, settings.size), num_timesteps=steps, **CFG)
        synchronize(device)
        if picture.size != (settings.size, settings.size):
            raise RuntimeError(f"the reference drew an image of {picture.size}")
        return time.perf_counter() - start_s

    picture = Image.open(io.BytesIO(png(settings.chat_image, settings.seed))).convert("RGB")

    @torch.no_grad()
    def chat(tokens: int) -> tuple[float, float]:
        """Seconds of the prompt (image and text into the cache) and of ``tokens`` new tokens."""
        synchronize(device)
        start_s = time.perf_counter()
        with (torch.device(device),
              torch.autocast(device_type="cuda", enabled=device.type == "cuda", dtype=torch.bfloat16)):
            context = held["inferencer"].init_gen_context()
            context = held["inferencer"].update_context_image(picture, context, vae=False)
            context = held["inferencer"].update_context_text(QUESTION, context)
            synchronize(device)
            prompt_s = time.perf_counter() - start_s
            start = held["model"].prepare_start_tokens(context["kv_lens"], context["ropes"], br.TOKENS)
            start_s = time.perf_counter()
            fed = held["model"].generate_text(context["past_key_values"], max_length=tokens, do_sample=False,
                                              end_token_id=None, **start)
            synchronize(device)
        if fed.shape[0] != tokens:
            raise RuntimeError(f"the reference gave {fed.shape[0]} tokens, not {tokens}")
        return prompt_s, time.perf_counter() - start_s

    try:
        t0 = time.perf_counter()
        image(2)
        chat(2)
        out["warmup_s"] = time.perf_counter() - t0
        out["s_per_image"] = [image(settings.steps) for _ in range(settings.runs)]
        out[f"s_per_{settings.concurrent}_images"] = [sum(image(settings.steps) for _ in range(settings.concurrent))
                                                      for _ in range(settings.runs)]
        one = [chat(1) for _ in range(settings.runs)]
        many = [chat(settings.chat_tokens) for _ in range(settings.runs)]
        out["chat_ttft_s"] = [p + g for p, g in one]
        out["chat_ms_per_token"] = [(g - statistics.median(x for _, x in one)) / max(settings.chat_tokens - 1, 1)
                                    * 1e3 for _, g in many]
        log.info("baseline: %.2f s per image; chat TTFT %.1f ms, %.2f ms/token",
                 statistics.median(out["s_per_image"]), statistics.median(out["chat_ttft_s"]) * 1e3,
                 statistics.median(out["chat_ms_per_token"]))
    finally:
        held.clear()
        free_device(settings.device)
    return out


# ---------------------------------------------------------------------------- report
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny model, CPU)" if settings.smoke else SCENARIO


def understanding_weights(llm: dict[str, Any]) -> float:
    """Parameters a decode step reads: the understanding copy of the layers and the LM head."""
    return generation_weights(llm) + llm["vocab_size"] * llm["hidden_size"]


def metrics_from(settings: Settings, rates: dict[str, float], ours: dict | None, ref: dict | None
                 ) -> list[Metric]:
    scenario, n = scenario_name(settings), settings.concurrent
    prompt_context = len(PROMPT) + 2  # the tiny tokenizer: a token per character, in <|im_start|> … <|im_end|>
    floor = image_floor_s(settings, rates, prompt_context)
    image = Metric(scenario, "image@1", "s/image", "lower", floor=floor["s"])
    batch = Metric(scenario, f"images@{n}", "images/s", "higher", floor=1 / floor["s"])
    ttft = Metric(scenario, "chat time to first token", "ms", "lower")
    tpot = Metric(scenario, "chat ms per output token", "ms", "lower",
                  floor=understanding_weights(settings.llm) * settings.dtype.itemsize
                  / (rates["bandwidth_gb_s"] * 1e9) * 1e3)
    for side, data in (("ours", ours), ("baseline", ref)):
        if not data:
            continue
        setattr(image, side, statistics.median(data["s_per_image"]))
        setattr(batch, side, n / statistics.median(data[f"s_per_{n}_images"]))
        setattr(ttft, side, statistics.median(data["chat_ttft_s"]) * 1e3)
        setattr(tpot, side, statistics.median(data["chat_ms_per_token"]))
    image.notes = {"image": f"{settings.size}x{settings.size}, {settings.steps} schedule points, CFG {CFG}",
                   "floor_s_three_variants": floor["s_three_variants"],
                   "floor_weight_read_s_per_step": floor["weight_read_s_per_step"],
                   "floor_leaves_out": "the prompt contexts and the VAE decode"}
    batch.notes = {"baseline_is": f"bagel2, {n} images one after the other (it has no batching across requests)"}
    ttft.notes = {"chat": f"one {settings.chat_image}x{settings.chat_image} image and a question, greedy"}
    tpot.notes = {"tokens": settings.chat_tokens, "floor_is": "one read of the understanding weights per token"}
    if ref:
        for row in (image, batch, ttft, tpot):
            row.notes["baseline_attention"] = ref["attention"]
    return [image, batch, ttft, tpot]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the code paths)")
    p.add_argument("--size", type=int, default=None, help="image side in pixels (default 1024; smoke 64)")
    p.add_argument("--steps", type=int, default=None, help="schedule points per image (default 50; smoke 3)")
    p.add_argument("--concurrent", type=int, default=4, help="images requested at once for images@N")
    p.add_argument("--chat-tokens", type=int, default=None, help="new tokens of the chat (default 128; smoke 32)")
    p.add_argument("--runs", type=int, default=1, help="timed runs of each row per side (median)")
    p.add_argument("--attention-backend", choices=("torch", "triton"), default="torch",
                   help="ours' paged attention (model_kwargs.attention_backend)")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--skip-baseline", action="store_true")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    attention = import_reference()  # first: the real flash_attn, when there is one, before the stand-in
    settings = settings_from(args)
    started = time.perf_counter()
    log.info("S10 settings: %s", settings.describe())
    rates = {"bf16": measure_matmul_tflops(settings.device, settings.dtype),
             "bandwidth_gb_s": measure_memory_bandwidth(settings.device)}
    log.info("measured %.1f TFLOP/s, %.0f GB/s", rates["bf16"], rates["bandwidth_gb_s"])
    ours = ref = None
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="s10-bagel-") as tmp:
        directory = model_dir(Path(tmp) / "model", settings)
        if not args.skip_ours:
            ours = run_ours(settings, directory)
        if not args.skip_baseline:
            try:
                ref = run_reference(settings, directory, attention)
            except Exception as err:  # keep ours' numbers when the baseline cannot run
                log.exception("the bagel2 baseline failed")
                errors["baseline"] = f"{type(err).__name__}: {err}"
    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"rates": rates, "generation_weights": generation_weights(settings.llm),
                     "understanding_weights": understanding_weights(settings.llm)},
        "metrics": metrics_from(settings, rates, ours, ref),
        "ours": ours,
        "baseline": ref,
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S10 done in %.1f s", record["total_s"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
