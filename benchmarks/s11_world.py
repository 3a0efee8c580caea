"""S11: world models: LingBot-World chunks/s and Waypoint frames/s, 1 and 4 rollouts at once.

Both families at their released shapes, bf16 on one GPU, dummy (seeded random) weights
(``load_format: dummy``); the script writes the model directories the deployments read, without
weights:

* **LingBot-World v2 1.3B causal-fast** (``lingbot_world_1_3b``): the Wan2.1-1.3B DiT layout
  (30 blocks, 12 heads of 128, FFN 8960, 36 input channels) with LingBot's camera layers, the
  UMT5-XXL prompt encoder (512 tokens), the Wan2.1 VAE (float32, as the family runs it). A
  rollout is one ``/generate`` request: a start image, a prompt, an orbiting camera path and
  ``--chunks`` chunks at 832x480 (a chunk is 3 latent frames: 9 video frames first, 12 after),
  streamed one ``video`` event a chunk.
* **Waypoint-1.5 1B** (``waypoint``): the 1.28B DiT (24 layers, width 2048, a 16 x 32 token grid
  a frame, four sigma steps and a clean pass a frame) and TAEHV; a rollout is one ``/generate``
  request: a seed image and ``--controls`` controls, one ``video`` event a control
  (``time_upscale`` = 4 frames at 1280x720).

Each deployment runs in this process; its requests go through the model's front end and the
runtime (no HTTP, no sessions: ``/generate``-style requests). N rollouts (``--sessions``, 1 and
4) are submitted at once and timed from the first submit to the last event; every event's
arrival is stamped (``TimedSink.data_times``). Rows per family and N:

* a rate: LingBot ``chunks/s@N`` and ``frames/s@N``; Waypoint ``frames/s@N`` (video frames)
  and ``steps/s@N`` (controls answered);
* the interval between a rollout's consecutive events after its first, p50 and p90 over every
  rollout of every run (LingBot: a chunk; Waypoint: one control's frames);
* the time to the first event (p50 over the rollouts).

No baseline: LingBot's reference rollout needs flash-attn and Waypoint has no pip reference, so
the baseline column is empty and the record says why.

Floor: per event, every DiT forward (LingBot: four steps and the commit; Waypoint: the sigma
steps and the clean pass) at the longer of its weights and the KV it reads at the measured copy
bandwidth, or its FLOPs at the measured bf16 matmul rate; plus the VAE work of the event
(LingBot: the condition's encode and the chunk's decode, float32 at the TF32 rate the
convolutions get; Waypoint: the TAEHV decode). FLOPs are torch's counts on the meta device; the
attention over the cache grows with the history (counted per event). Per rollout the prompt
encoder (LingBot) or the seed's encode and clean pass (Waypoint) come first. The rate's floor is
N rollouts' events over the sum of their floors; the latency rows' floor is one event's.

``--smoke`` runs the same code paths with tiny shapes in float32 on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    Metric,
    TimedSink,
    add_run_args,
    free_device,
    hardware,
    measure_matmul_tflops,
    measure_memory_bandwidth,
    setup_logging,
    wait_all,
    write_record,
)
from benchmarks.s8_wan22 import TINY_UMT5, UMT5_XXL, t5_tokenizer, tf32_tflops

NAME = "s11_world"
SCENARIO = "S11 world models"
PROMPT = "a quiet mountain village at dusk, snow on the roofs, lanterns in the windows"
NO_BASELINE = ("no reference baseline in this stack: LingBot-World's reference rollout needs flash-attn, and "
               "Waypoint has no pip reference (its port was written from Overworld's sources)")
MODELS = ("lingbot", "waypoint")

log = logging.getLogger("s11")

# robbyant/lingbot-world-v2-1.3b-causal-fast's config.json (the reference's names): Wan2.1-1.3B
LINGBOT_DIT: dict[str, Any] = {
    "model_type": "i2v", "patch_size": [1, 2, 2], "text_len": 512, "in_dim": 36, "dim": 1536, "ffn_dim": 8960,
    "freq_dim": 256, "text_dim": 4096, "out_dim": 16, "num_heads": 12, "num_layers": 30, "local_attn_size": -1,
    "sink_size": 0, "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
}
# Wan2.1's VAE (vae/config.json of Wan-AI/Wan2.1-T2V-1.3B-Diffusers; latent statistics 0 and 1:
# the weights are random)
WAN21_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True], "is_residual": False, "dropout": 0.0,
    "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16,
}
TINY_LINGBOT_DIT: dict[str, Any] = {**LINGBOT_DIT, "dim": 24, "ffn_dim": 40, "freq_dim": 32, "text_dim": 32,
                                    "num_heads": 2, "num_layers": 2}
TINY_WAN21_VAE: dict[str, Any] = {**WAN21_VAE, "base_dim": 4, "num_res_blocks": 1}

# Waypoint-1.5-1B's config.yaml (720p: a 16 x 32 token grid of 2 x 2 latent cells; the family's
# defaults, which are Overworld's quark numbers) and TAEHV 1.5's config
WAYPOINT_DIT: dict[str, Any] = {
    "d_model": 2048, "n_heads": 32, "n_kv_heads": 16, "n_layers": 24, "mlp_ratio": 4, "channels": 32, "height": 16,
    "width": 32, "patch": [2, 2], "n_frames": 512, "n_buttons": 256, "local_window": 16, "global_window": 128,
    "global_attn_period": 4, "global_attn_offset": -1, "global_pinned_dilation": 8, "ctrl_conditioning_period": 3,
    "noise_conditioning": "wan", "value_residual": True, "gated_attn": False, "ctrl_conditioning": "mlp_fusion",
    "scheduler_sigmas": [1.0, 0.9, 0.75, 0.3, 0.0],
}
TAEHV_1_5: dict[str, Any] = {"latent_channels": 32, "patch_size": 2, "encoder_time_downscale": [True, True, False],
                             "decoder_time_upscale": [False, True, True], "decoder_space_upscale": [True, True, True]}
TINY_WAYPOINT_DIT: dict[str, Any] = {
    **WAYPOINT_DIT, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "n_layers": 3, "mlp_ratio": 2, "channels": 4,
    "height": 2, "width": 2, "patch": [1, 2], "n_frames": 64, "n_buttons": 5, "local_window": 2, "global_window": 8,
    "global_attn_period": 2, "global_attn_offset": 0, "global_pinned_dilation": 2, "ctrl_conditioning_period": 2,
    "scheduler_sigmas": [1.0, 0.6, 0.3, 0.0],
}
TINY_TAEHV: dict[str, Any] = {**TAEHV_1_5, "latent_channels": 4, "patch_size": 1}


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    models: tuple[str, ...]
    sessions: tuple[int, ...]  # rollouts submitted at once
    runs: int
    lingbot_dit: dict[str, Any]
    lingbot_text: dict[str, Any]
    lingbot_vae: dict[str, Any]
    width: int
    height: int
    chunks: int  # chunks a LingBot rollout makes
    waypoint_dit: dict[str, Any]
    waypoint_ae: dict[str, Any]
    controls: int  # controls a Waypoint rollout sends
    seed: int

    @property
    def num_frames(self) -> int:
        """LingBot's video frames: 9 for the first chunk, 12 for each after it."""
        return 12 * self.chunks - 3

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(dtype=str(self.dtype).removeprefix("torch."), models=list(self.models),
                   sessions=list(self.sessions), num_frames=self.num_frames, load_format="dummy", prompt=PROMPT)
        return out


def settings_from(args: argparse.Namespace) -> Settings:
    models = MODELS if args.model == "both" else (args.model,)
    if args.smoke:
        device, dtype, runs = "cpu", torch.float32, args.runs or 1
        lingbot = (TINY_LINGBOT_DIT, TINY_UMT5, TINY_WAN21_VAE)
        waypoint = (TINY_WAYPOINT_DIT, TINY_TAEHV)
        width, height, chunks, controls = args.width or 32, args.height or 32, args.chunks or 2, args.controls or 3
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S11 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, runs = "cuda", torch.bfloat16, args.runs or 2
        lingbot = (LINGBOT_DIT, UMT5_XXL, WAN21_VAE)
        waypoint = (WAYPOINT_DIT, TAEHV_1_5)
        width, height = args.width or 832, args.height or 480
        chunks, controls = args.chunks or 4, args.controls or 32
    sessions = tuple(sorted({int(n) for n in args.sessions.split(",")}))
    if chunks < 1 or controls < 1 or min(sessions) < 1:
        raise SystemExit("--chunks, --controls and --sessions must be at least 1")
    return Settings(smoke=args.smoke, device=device, dtype=dtype, models=models, sessions=sessions, runs=runs,
                    lingbot_dit=dict(lingbot[0]), lingbot_text=dict(lingbot[1]), lingbot_vae=dict(lingbot[2]),
                    width=width, height=height, chunks=chunks, waypoint_dit=dict(waypoint[0]),
                    waypoint_ae=dict(waypoint[1]), controls=controls, seed=args.seed)


# ------------------------------------------------------------------------ the checkpoints
def write_lingbot_dir(settings: Settings, root: Path) -> Path:
    """A LingBot-World release without weights: the DiT's ``config.json`` (the reference's names)
    at the root, and the Wan2.1 assets beside it (``tokenizer/``, ``text_encoder/`` and ``vae/``
    configs), so the deployment reads its assets from the release directory."""
    from transformers import UMT5Config

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(settings.lingbot_dit, indent=2))
    t5_tokenizer().save_pretrained(root / "tokenizer")
    for folder, config in (("text_encoder", UMT5Config(**settings.lingbot_text).to_dict()),
                           ("vae", settings.lingbot_vae)):
        (root / folder).mkdir(exist_ok=True)
        (root / folder / "config.json").write_text(json.dumps(config, indent=2))
    return root


def write_waypoint_dir(settings: Settings, root: Path) -> Path:
    """A Waypoint directory without weights: ``config.yaml`` naming ``ae_uri: ae`` and the
    autoencoder's ``ae/config.json``."""
    import yaml

    (root / "ae").mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump({**settings.waypoint_dit, "ae_uri": "ae"}))
    (root / "ae" / "config.json").write_text(json.dumps(settings.waypoint_ae))
    return root


def png(width: int, height: int, seed: int) -> bytes:
    """A random RGB image, PNG-encoded."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def orbit(frames: int, step: float = 0.02) -> list:
    """Camera-to-world poses ``[F, 3, 4]`` turning about y and moving forward."""
    import math

    poses = []
    for i in range(frames):
        a = step * i
        rot = [[math.cos(a), 0.0, math.sin(a)], [0.0, 1.0, 0.0], [-math.sin(a), 0.0, math.cos(a)]]
        poses.append([rot[r] + [0.05 * i if r == 2 else 0.0] for r in range(3)])
    return poses


def controls(n: int, n_buttons: int, seed: int) -> list[dict[str, Any]]:
    """``n`` controller inputs: a few held buttons, a mouse velocity, a scroll."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        buttons = sorted({int(b) for b in torch.randint(0, n_buttons, (2,), generator=gen)})
        mouse = (torch.randn(2, generator=gen) * 0.3).tolist()
        out.append({"buttons": buttons, "mouse": mouse, "scroll": int(torch.randint(-1, 2, (1,), generator=gen))})
    return out


# ------------------------------------------------------------------------------ the floor
@dataclass(frozen=True)
class Work:
    """What a part of an event must do: bytes read at least once, FLOPs at a matmul rate."""

    bytes: float
    flops: float
    tflops: float  # the measured rate its FLOPs run at

    def seconds(self, bandwidth_gbs: float) -> float:
        return max(self.bytes / (bandwidth_gbs * 1e9), self.flops / (self.tflops * 1e12))


def counted_flops(run: Callable[[], Any]) -> float:
    """FLOPs of ``run()`` by torch's FLOP counter (run it on the meta device: shapes only)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        run()
    return float(counter.get_total_flops())


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass
class Floor:
    """Per-event work of one family's rollout (``events[i]``: the i-th event's parts) and the
    work before its first event (``start``), and the seconds each takes at the measured rates."""

    start: list[Work]
    events: list[list[Work]]
    bandwidth_gbs: float
    params: dict[str, int] = field(default_factory=dict)

    def event_s(self, i: int) -> float:
        return sum(w.seconds(self.bandwidth_gbs) for w in self.events[i])

    def start_s(self) -> float:
        return sum(w.seconds(self.bandwidth_gbs) for w in self.start)

    def rollout_s(self) -> float:
        return self.start_s() + sum(self.event_s(i) for i in range(len(self.events)))

    def steady_event_s(self) -> float:
        """The mean floor of the events after the first."""
        rest = range(1, len(self.events)) if len(self.events) > 1 else range(1)
        return statistics.fmean(self.event_s(i) for i in rest)

    def describe(self) -> dict[str, Any]:
        def parts(works: list[Work]) -> list[dict[str, float]]:
            return [{"gb": w.bytes / 1e9, "tflop": w.flops / 1e12, "tflops_rate": w.tflops} for w in works]

        return {"params": self.params, "start_s": self.start_s(), "event_s": [self.event_s(i) for i in
                                                                               range(len(self.events))],
                "start": parts(self.start), "first_event": parts(self.events[0]),
                "last_event": parts(self.events[-1])}


def lingbot_floor(settings: Settings, bandwidth_gbs: float, rates: dict[str, float]) -> Floor:
    """The DiT's forwards, the VAE's encode and decode and UMT5 of a ``--chunks`` rollout, from
    torch's FLOP counts on the meta device. A forward's attention grows with the history; two
    counts (no history, one chunk of it) give its cost per history frame."""
    from mstar.model.lingbot.checkpoint import config_from_reference
    from mstar.model.lingbot.config import LingbotConfig
    from mstar.model.lingbot.engine import RolloutVAE
    from mstar.model.lingbot.transformer import LingbotTransformer
    from mstar.model.wan22.umt5 import UMT5Config, UMT5Encoder
    from mstar.model.wan22.vae import WanVAE, WanVAEConfig

    config = config_from_reference(settings.lingbot_dit, LingbotConfig())
    dit_cfg, dtype, size = config.dit, settings.dtype, torch.finfo(settings.dtype).bits // 8
    c, (_, sh, sw) = config.chunk_frames, config.vae_stride
    h, w = settings.height // sh, settings.width // sw
    frame_tokens = (h // dit_cfg.patch_size[1]) * (w // dit_cfg.patch_size[2])
    steps = len(config.timestep_indices)
    with torch.device("meta"):
        dit = LingbotTransformer(config).to(dtype)
        for name, param in dit.named_parameters():  # as the loader keeps them
            if {"time_embedder", "scale_shift_table"} & set(name.split(".")):
                param.data = param.data.float()
        x = torch.zeros(1, dit_cfg.in_channels, c, h, w, dtype=dtype)
        text = torch.zeros(1, config.text_len, dit_cfg.text_dim, dtype=dtype)
        rays = torch.zeros(1, config.camera_channels, c, h, w, dtype=dtype)
        cache = dit.new_cache()
        fresh = counted_flops(lambda: dit(x, torch.zeros(1), text, rays, cache, commit=True))
        after_one = counted_flops(lambda: dit(x, torch.zeros(1), text, rays, cache))
        per_history_frame = (after_one - fresh) / c
        kv_frame_bytes = dit_cfg.num_layers * 2 * frame_tokens * dit_cfg.dim * size

        vae = WanVAE(WanVAEConfig.from_dict(settings.lingbot_vae))
        rollout_vae = RolloutVAE(vae, torch.zeros(1, 3, 1, settings.height, settings.width))
        latents = torch.zeros(1, vae.config.z_dim, c, h, w)
        vae_flops = [counted_flops(lambda k=k: (rollout_vae.condition((k + 1) * c), rollout_vae.decode(latents)))
                     for k in range(min(2, settings.chunks))]  # the first chunk, then every later one alike

        umt5 = UMT5Encoder(UMT5Config.from_dict(settings.lingbot_text)).to(dtype)
        ids = torch.zeros(1, config.text_len, dtype=torch.int64)
        text_flops = counted_flops(lambda: umt5(ids, ids + 1))
    dit_bytes, vae_bytes = param_bytes(dit), param_bytes(vae)
    text_bytes = param_bytes(umt5) - param_bytes(umt5.shared)  # the embedding is a lookup of 512 rows

    events = []
    for k in range(settings.chunks):
        history = k * c if config.window_frames is None else min(k * c, config.window_frames - c)
        forward = Work(dit_bytes + history * kv_frame_bytes, fresh + history * per_history_frame, rates["bf16"])
        dit_work = Work((steps + 1) * forward.bytes, (steps + 1) * forward.flops, rates["bf16"])
        events.append([dit_work, Work(vae_bytes, vae_flops[min(k, 1)], rates["tf32"])])
    params = {"dit": sum(p.numel() for p in dit.parameters()), "vae": sum(p.numel() for p in vae.parameters()),
              "text_encoder": sum(p.numel() for p in umt5.parameters())}
    return Floor([Work(text_bytes, text_flops, rates["bf16"])], events, bandwidth_gbs, params)


def waypoint_floor(settings: Settings, bandwidth_gbs: float, rates: dict[str, float]) -> Floor:
    """The DiT's sigma steps and clean pass per control and the TAEHV decode, from torch's FLOP
    counts on the meta device; the attention over the cached frames a layer keeps is added per
    frame (4 FLOPs per query, key and width: ``QK^T`` and ``PV``)."""
    from mstar.model.waypoint.config import TAEHVConfig, WaypointConfig
    from mstar.model.waypoint.dit import WorldDiT, frame_visible
    from mstar.model.waypoint.taehv import TAEHV, StreamingDecoder

    config = WaypointConfig.from_dict(settings.waypoint_dit)
    ae = TAEHVConfig.from_dict(settings.waypoint_ae)
    dtype, size = settings.dtype, torch.finfo(settings.dtype).bits // 8
    tokens = config.tokens_per_frame
    latent = (config.channels, config.height * config.patch[0], config.width * config.patch[1])
    with torch.device("meta"):
        dit, tae = WorldDiT(config).to(dtype), TAEHV(ae).to(dtype)
        x = torch.zeros(1, 1, *latent, dtype=dtype)
        sigma, control = torch.zeros(1, 1, dtype=dtype), torch.zeros(1, 1, config.control_dim, dtype=dtype)
        seed = torch.zeros(1, ae.time_downscale, 3, latent[1] * ae.space_scale, latent[2] * ae.space_scale,
                           dtype=dtype)
    # counted outside the meta context: the attention mask is built on the host from frame indices
    forward_flops = counted_flops(lambda: dit(x, sigma, 0, control))
    decoder = StreamingDecoder(tae)
    decode_flops = [counted_flops(lambda: decoder.push(x)) for _ in range(2)]  # primed first, then steady
    encode_flops = counted_flops(lambda: tae.encode_whole(seed))
    dit_bytes, tae_bytes = param_bytes(dit), param_bytes(tae)
    kv_token_bytes = 2 * config.kv_heads * config.head_dim * size

    def forward(frame: int) -> Work:
        past = [sum(frame_visible(frame, f, *config.window(layer)) for f in range(frame))
                for layer in range(config.n_layers)]
        attention = sum(4.0 * tokens * p * tokens * config.d_model for p in past)
        return Work(dit_bytes + sum(past) * tokens * kv_token_bytes, forward_flops + attention, rates["bf16"])

    events = []
    for i in range(settings.controls):
        one = forward(i + 1)  # frame 0 is the seed
        passes = config.num_steps + 1  # the sigma steps and the clean pass
        events.append([Work(passes * one.bytes, passes * one.flops, rates["bf16"]),
                       Work(tae_bytes, decode_flops[min(i, 1)], rates["bf16"])])
    start = [Work(tae_bytes, encode_flops, rates["bf16"]), forward(0)]
    params = {"dit": sum(p.numel() for p in dit.parameters()), "taehv": sum(p.numel() for p in tae.parameters())}
    return Floor(start, events, bandwidth_gbs, params)


# ------------------------------------------------------------------------------- ours
class World:
    """One family's deployment in this process; ``run(n)`` submits n rollouts at once."""

    def __init__(self, settings: Settings, family: str, model_dir: Path):
        import mstar.model.lingbot.model  # noqa: F401  (registers the families)
        import mstar.model.waypoint.model  # noqa: F401
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        self.settings, self.family = settings, family
        kwargs: dict[str, Any] = {"seed": settings.seed}
        if family == "lingbot":
            key = "lingbot_world_1_3b"
            kwargs["max_image_area"] = max(settings.width * settings.height, 64 * 64)
        else:
            key = "waypoint"
            kwargs["max_frames"] = max(settings.controls, 1)
        self.config = parse_config({
            "model": key, "model_path": str(model_dir), "load_format": "dummy", "device": settings.device,
            "dtype": str(settings.dtype).removeprefix("torch."), "max_concurrent_requests": max(settings.sessions),
            "model_kwargs": kwargs}, "s11 config")
        t0 = time.perf_counter()
        self.deployment = start(self.config, in_process=True)
        self.startup_s = time.perf_counter() - t0
        self.calls = 0
        spec = self.deployment.spec
        if family == "lingbot":
            self.image = png(settings.width, settings.height, settings.seed + 1)
            frame = settings.width * settings.height * 3
            self.event_bytes = [9 * frame] + [12 * frame] * (settings.chunks - 1)
            self.frames_per_event = [9] + [12] * (settings.chunks - 1)
        else:
            t, height, width, _ = spec.frame_shape
            self.image = png(width, height, settings.seed + 1)  # a display-sized seed, resized by the front end
            self.controls = controls(settings.controls, spec.world_config.n_buttons, settings.seed + 2)
            self.event_bytes = [t * height * width * 3] * settings.controls
            self.frames_per_event = [t] * settings.controls

    def spec(self, i: int):
        from mstar.contract import GenerateSpec

        request_id = f"s11-{self.family}-{self.calls}-{i}"
        s = self.settings
        if self.family == "lingbot":
            kwargs = {"width": s.width, "height": s.height, "num_frames": s.num_frames, "seed": s.seed + i,
                      "camera_poses": orbit(s.num_frames, 0.02 * (i + 1))}
            return GenerateSpec(request_id, PROMPT, [("start.png", self.image)], ["video"], kwargs, stream=True)
        kwargs = {"controls": self.controls, "seed": s.seed + i}
        return GenerateSpec(request_id, "", [("seed.png", self.image)], ["video"], kwargs, stream=True)

    def run(self, n: int, timeout_s: float = 540.0) -> dict[str, Any]:
        """Submit ``n`` rollouts at once: the wall time until the last event, and every rollout's
        event times (seconds after its submit)."""
        self.calls += 1
        spec = self.deployment.spec
        specs = [self.spec(i) for i in range(n)]
        sinks = [TimedSink() for _ in specs]
        start = time.perf_counter()
        for s, sink in zip(specs, sinks, strict=True):
            sink.submitted = time.perf_counter()
            request = spec.prepare_generate(s)
            self.deployment.runtime.submit(s.request_id, request, spec.output_stream(request, []), sink)
        wait_all(sinks, timeout_s)
        ended = time.perf_counter()
        for i, sink in enumerate(sinks):
            if sink.error or sink.finish_reason != "stop" or sink.data_sizes != self.event_bytes:
                raise RuntimeError(f"{self.family} rollout {i}: error {sink.error!r}, finish {sink.finish_reason!r}, "
                                   f"events of {sink.data_sizes} bytes (expected {self.event_bytes})")
        return {"wall_s": ended - start, "events_s": [[t - s.submitted for t in s.data_times] for s in sinks]}

    def close(self) -> None:
        self.deployment.close()
        del self.deployment


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the order statistics."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def summarise(runs: list[dict[str, Any]], n: int, events: int, frames: int) -> dict[str, Any]:
    """Rates at the median wall time; intervals and first events over every rollout of every run."""
    wall = statistics.median(r["wall_s"] for r in runs)
    intervals = [b - a for r in runs for times in r["events_s"] for a, b in zip(times, times[1:])]
    firsts = [times[0] for r in runs for times in r["events_s"]]
    out = {"runs": runs, "wall_s_median": wall, "events_per_s": n * events / wall, "frames_per_s": n * frames / wall,
           "first_event_ms_p50": 1e3 * statistics.median(firsts)}
    if intervals:
        out.update(interval_ms_p50=1e3 * percentile(intervals, 50), interval_ms_p90=1e3 * percentile(intervals, 90))
    return out


def run_family(settings: Settings, family: str, model_dir: Path) -> dict[str, Any]:
    """Start the deployment, one warm-up rollout per concurrency, then ``runs`` timed ones each."""
    t0 = time.perf_counter()
    world = World(settings, family, model_dir)
    out: dict[str, Any] = {"startup_s": world.startup_s, "warmup_s": {}}
    log.info("%s: deployment ready in %.1f s", family, world.startup_s)
    try:
        for n in settings.sessions:  # the first rollouts build the kernels (cuDNN picks the VAE's convolutions)
            w0 = time.perf_counter()
            world.run(n)
            out["warmup_s"][n] = time.perf_counter() - w0
        events, frames = len(world.event_bytes), sum(world.frames_per_event)
        for n in settings.sessions:
            out[n] = summarise([world.run(n) for _ in range(settings.runs)], n, events, frames)
            log.info("%s at %d: %.2f events/s, %.1f frames/s, interval p50 %s ms, first event %.0f ms", family, n,
                     out[n]["events_per_s"], out[n]["frames_per_s"], f"{out[n].get('interval_ms_p50', 0):.0f}",
                     out[n]["first_event_ms_p50"])
        out["events_per_rollout"], out["frames_per_rollout"] = events, frames
    finally:
        world.close()
        free_device(settings.device)
    out["total_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------- metrics
def rollout_size(settings: Settings, family: str) -> tuple[int, int]:
    """``(events, video frames)`` of one rollout: LingBot's chunks and frames, Waypoint's controls
    and ``time_upscale`` frames each."""
    if family == "lingbot":
        return settings.chunks, settings.num_frames
    from mstar.model.waypoint.config import TAEHVConfig

    return settings.controls, settings.controls * TAEHVConfig.from_dict(settings.waypoint_ae).time_upscale


def metrics_from(settings: Settings, floors: dict[str, Floor], results: dict[str, dict[str, Any]]) -> list[Metric]:
    """Per family and concurrency N: the rates, the event interval p50 and p90, the first event."""
    rows: list[Metric] = []
    name = scenario_name(settings)
    units = {"lingbot": ("chunk", "chunks"), "waypoint": ("step", "steps")}
    for family in settings.models:
        floor, result = floors[family], results.get(family, {})
        unit, plural = units[family]
        events, frames = rollout_size(settings, family)
        for n in settings.sessions:
            mine = result.get(n, {})
            notes = {"baseline_is": NO_BASELINE, "events_per_rollout": events, "rollouts": n,
                     "floor_rollout_s": floor.rollout_s(), "floor_first_event_s": floor.event_s(0),
                     "floor_steady_event_s": floor.steady_event_s(),
                     "ours_is": f"{family} deployment in process: /generate-style requests, submit to last event",
                     **{f"ours_{k}": v for k, v in mine.items() if k != "runs"}}
            # n rollouts make n times the events in at least n times one rollout's floor
            rows.append(Metric(name, f"{family} {plural}/s@{n}", f"{unit}/s", "higher", ours=mine.get("events_per_s"),
                               floor=events / floor.rollout_s(), notes=notes))
            rows.append(Metric(name, f"{family} frames/s@{n}", "frame/s", "higher", ours=mine.get("frames_per_s"),
                               floor=frames / floor.rollout_s(), notes=notes))
            for q in (50, 90):
                rows.append(Metric(name, f"{family} {unit} interval p{q}@{n}", "ms", "lower",
                                   ours=mine.get(f"interval_ms_p{q}"), floor=floor.steady_event_s() * 1e3, notes=notes))
            rows.append(Metric(name, f"{family} first {unit}@{n}", "ms", "lower", ours=mine.get("first_event_ms_p50"),
                               floor=(floor.start_s() + floor.event_s(0)) * 1e3, notes=notes))
    return rows


# ------------------------------------------------------------------------------ main
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny shapes, CPU)" if settings.smoke else SCENARIO


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the code paths)")
    p.add_argument("--model", choices=("lingbot", "waypoint", "both"), default="both")
    p.add_argument("--sessions", default="1,4", help="rollouts submitted at once")
    p.add_argument("--runs", type=int, default=None, help="timed rounds per concurrency (default 2; smoke 1)")
    p.add_argument("--chunks", type=int, default=None, help="LingBot chunks a rollout (default 4: 45 frames; smoke 2)")
    p.add_argument("--width", type=int, default=None, help="LingBot width (default 832; smoke 32)")
    p.add_argument("--height", type=int, default=None, help="LingBot height (default 480; smoke 32)")
    p.add_argument("--controls", type=int, default=None, help="Waypoint controls a rollout (default 32; smoke 3)")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(args)
    started = time.perf_counter()
    log.info("S11 settings: %s", {k: v for k, v in settings.describe().items() if not isinstance(v, dict)})
    if settings.smoke:  # the CPU's rates, quickly: smaller buffers and products
        bandwidth = measure_memory_bandwidth("cpu", 64 * 2**20)
        rates = {"bf16": measure_matmul_tflops("cpu", settings.dtype, 512)}
        rates["tf32"] = rates["bf16"]
    else:
        bandwidth = measure_memory_bandwidth(settings.device)
        rates = {"bf16": measure_matmul_tflops(settings.device, settings.dtype), "tf32": tf32_tflops(settings.device)}
    log.info("measured %.0f GB/s copy bandwidth, %.1f TFLOP/s %s matmul, %.1f float32 (TF32)", bandwidth,
             rates["bf16"], settings.dtype, rates["tf32"])
    builders = {"lingbot": lingbot_floor, "waypoint": waypoint_floor}
    floors = {family: builders[family](settings, bandwidth, rates) for family in settings.models}
    for family, floor in floors.items():
        log.info("%s floor: %.1f ms to start, %.1f ms the first event, %.1f ms a later one; %s", family,
                 floor.start_s() * 1e3, floor.event_s(0) * 1e3, floor.steady_event_s() * 1e3, floor.params)

    errors: dict[str, str] = {}
    results: dict[str, dict[str, Any]] = {}
    writers = {"lingbot": write_lingbot_dir, "waypoint": write_waypoint_dir}
    with tempfile.TemporaryDirectory(prefix="s11-") as tmp:
        for family in settings.models:
            try:
                results[family] = run_family(settings, family, writers[family](settings, Path(tmp) / family))
            except Exception as err:  # keep the other family's numbers
                log.exception("%s failed", family)
                errors[family] = f"{type(err).__name__}: {err}"
    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"memory_bandwidth_gbs": bandwidth, "matmul_tflops": rates,
                     **{family: floor.describe() for family, floor in floors.items()}},
        "metrics": metrics_from(settings, floors, results),
        "ours": _jsonable(results),
        "baseline": {"unavailable": NO_BASELINE},
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S11 done in %.1f s%s", record["total_s"], f"; errors: {sorted(errors)}" if errors else "")
    return 1 if errors else 0


def _jsonable(value: Any) -> Any:
    """Integer keys (rollout counts) as strings, for JSON."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
