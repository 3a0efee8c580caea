"""S10: Pi0.5 action chunks per second, served M* against transformers' ``sample_actions``.

Pi0.5 at the released shapes (``lerobot/pi05_base``: PaliGemma 2B with SigLIP so400m/14 at
224x224, the Gemma 300M action expert, a chunk of 50 actions of width 32, 10 Euler steps),
three cameras per observation, a task and a 32-value state in the prompt, bf16 on one GPU,
dummy (seeded random) weights. Each observation is one ``/generate`` request for an action.

* **ours**: a ``pi05`` deployment in this process (``load_format: dummy``), its requests
  prepared by the model's front end (PNG decode, resize, prompt, noise), all N of them, and then
  submitted to the runtime together (N = 1 and 16). ``--compile`` adds a variant with ``model_kwargs.compile``
  (the expert's norms and MLPs compiled; ``mstar.model.pi05.fast``), ``--cuda-graphs`` one with
  ``model_kwargs.cuda_graphs`` (each denoise step replayed from a CUDA graph), and both
  together a fourth.
* **baseline**: transformers' ``PI05ForConditionalGeneration.sample_actions`` in the same
  process, with ours' weights copied in (the same seeded dummy weights, built once more and
  renamed), on a batch of N already-preprocessed observations: pixels on the device, ids of
  the same prompt, noise given. ``--baseline-compile`` runs it with ``model.compile()`` too (the
  denoise forward it calls each step). Where the installed transformers has no ``pi05``
  (before 5.19), the baseline column is left empty and the record says why.

Metrics: ``latency@1`` (ms per chunk, one observation), and at N = 16 ``chunks/s@16`` and
``actions/s@16`` (chunks x 50), and ``chunks/s@16, inputs prepared``: ours' batch timed from
the end of the last front end, as the baseline's covers ``sample_actions`` on inputs
already prepared. Ours' times are wall clock from before the first observation's
front end to the last chunk (the front end included: ``front_ms_median`` is its share); the
baseline's are ``sample_actions`` alone (CUDA-synchronised). Median of ``--runs`` after a
warm-up.

The N observations stand for N robots' requests arriving together, so all N go through the
front end before any is submitted, on a thread pool sized as asyncio's default executor (a
server prepares concurrent requests in threads, ``asyncio.to_thread``). Until 2026-12-07 each
was submitted as soon as it was prepared: the first then started its prefill alone while the
rest were still being decoded, and the 16 trickled in. On the CPU smoke path with S10's real
camera PNGs (three 224x224 an observation, about 3 ms of front end each) the 16 ran as 14
prefills of one or two observations in 18 engine calls, whose denoise forwards held 1 to 5
requests. Prepared first, they run in 6: a prefill of the first alone (the runtime starts a
submission at once, and the next arrives while it runs), one of the other 15, then denoise
forwards of all 16, the first one step ahead (``tests/benchmarks/test_s10_pi05.py`` pins the
order). Until later that day the front ends ran one after another in one thread (at 16
observations on an H100, 107 ms of a 353 ms batch), which no server does.

Floor per batch of N: the prefix phase (SigLIP over 3N images, the projector, the language
model over the N prefixes) and then ``steps`` expert forwards over N x 50 tokens. Each phase
takes at least its weights read once plus the KV it reads at the measured copy bandwidth, or
its FLOPs (2 per multiply-add of every matrix product, attention included) at the measured
bf16 matmul rate, whichever is longer; the floor is the sum over phases. Parameter counts
come from our policy built on the meta device (``tests/benchmarks/test_s10_pi05.py`` checks
them against transformers').

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
    synchronize,
    wait_all,
    write_record,
)

NAME = "s10_pi05"
SCENARIO = "S10 pi05"
CAMERAS = ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb",
           "observation.images.right_wrist_0_rgb")
TASK = "pick up the red cube and put it in the blue bowl"
PAGE_SIZE = 16

log = logging.getLogger("s10")

# lerobot/pi05_base's config.json, the parts the policy reads (sizes by variant name)
RELEASED: dict[str, Any] = {
    "type": "pi05", "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m",
    "chunk_size": 50, "n_action_steps": 50, "max_state_dim": 32, "max_action_dim": 32, "num_inference_steps": 10,
    "image_resolution": [224, 224], "tokenizer_max_length": 200,
}
# the smoke test's shapes: every size spelt out under "dims"
TINY_DIMS: dict[str, Any] = {
    "vocab_size": 512,
    "vision": {"hidden_size": 24, "intermediate_size": 48, "num_layers": 2, "num_heads": 2, "patch_size": 4},
    "text": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
             "head_dim": 16},
    "expert": {"hidden_size": 24, "intermediate_size": 48, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
               "head_dim": 16},
}
TINY: dict[str, Any] = {**RELEASED, "chunk_size": 5, "n_action_steps": 5, "max_state_dim": 6, "max_action_dim": 6,
                        "num_inference_steps": 3, "image_resolution": [16, 16], "dims": TINY_DIMS}


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    lerobot: dict[str, Any]  # the policy's config.json
    cameras: int
    batches: tuple[int, ...]
    runs: int
    compile: bool
    cuda_graphs: bool
    baseline_compile: bool
    skip_ours: bool
    skip_baseline: bool
    seed: int
    skip_eager: bool = False
    front_threads: int | None = None  # None: asyncio.to_thread's default executor's size

    @property
    def state_dim(self) -> int:
        return int(self.lerobot["max_state_dim"])

    def describe(self) -> dict[str, Any]:
        return {"smoke": self.smoke, "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
                "config": self.lerobot, "cameras": self.cameras, "batches": list(self.batches), "runs": self.runs,
                "compile": self.compile, "cuda_graphs": self.cuda_graphs, "baseline_compile": self.baseline_compile,
                "task": TASK, "seed": self.seed, "page_size": PAGE_SIZE, "load_format": "dummy",
                "front_threads": self.front_threads}


def settings_from(args: argparse.Namespace) -> Settings:
    if args.smoke:
        device, dtype, lerobot, batches, runs = "cpu", torch.float32, TINY, (1, 4), args.runs or 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S10 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, lerobot, batches, runs = "cuda", torch.bfloat16, RELEASED, (1, 16), args.runs or 5
    if args.batches:
        batches = tuple(sorted({int(b) for b in args.batches.split(",")}))
    if not 1 <= args.cameras <= len(CAMERAS):
        raise SystemExit(f"--cameras must be 1 to {len(CAMERAS)}")
    if args.steps is not None:
        lerobot = {**lerobot, "num_inference_steps": args.steps}
    return Settings(smoke=args.smoke, device=device, dtype=dtype, lerobot=dict(lerobot), cameras=args.cameras,
                    batches=batches, runs=runs, compile=args.compile, cuda_graphs=args.cuda_graphs,
                    baseline_compile=args.baseline_compile,
                    skip_ours=args.skip_ours, skip_baseline=args.skip_baseline, seed=args.seed,
                    skip_eager=args.skip_eager, front_threads=args.front_threads)


def lerobot_config(settings: Settings) -> dict[str, Any]:
    """The policy directory's ``config.json``: the shapes, its cameras, state and action."""
    size = settings.lerobot["image_resolution"][0]
    width = settings.state_dim
    inputs = {name: {"type": "VISUAL", "shape": [3, size, size]} for name in CAMERAS}
    inputs["observation.state"] = {"type": "STATE", "shape": [width]}
    return {**settings.lerobot, "input_features": inputs,
            "output_features": {"action": {"type": "ACTION", "shape": [settings.lerobot["max_action_dim"]]}}}


# ------------------------------------------------------------------------ the checkpoint
def write_policy_dir(settings: Settings, directory: Path) -> Path:
    """A lerobot Pi0.5 directory without weights (``load_format: dummy``): the config, identity
    statistics (mean 0, std 1) and a word-level tokenizer standing in for PaliGemma's."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(lerobot_config(settings)))
    width = settings.state_dim
    stats = {"mean": torch.zeros(width), "std": torch.ones(width)}
    tensors = {f"{key}.{k}": v.clone() for key in ("observation.state", "action") for k, v in stats.items()}
    save_file(tensors, str(directory / "pre.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith("action.")}, str(directory / "post.safetensors"))
    norm = {"eps": 1e-8, "norm_map": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
            "features": {}}
    (directory / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": [
        {"registry_name": "normalizer_processor", "config": norm, "state_file": "pre.safetensors"}]}))
    (directory / "policy_postprocessor.json").write_text(json.dumps({"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": norm, "state_file": "post.safetensors"}]}))
    write_word_tokenizer(directory)
    return directory


def write_word_tokenizer(directory: Path) -> None:
    """One id per word, number or punctuation mark of the prompt (``<bos>`` first): about the
    prompt length PaliGemma's tokenizer gives (the 32 state bins are 32 numbers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>", *(str(i) for i in range(256)), "Task", "State", "Action", ":",
             ",", ";", *TASK.split()]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(directory)


def camera_pngs(settings: Settings, seed: int) -> list[bytes]:
    """``cameras`` random RGB images at the tower's resolution, PNG-encoded."""
    import numpy as np
    from PIL import Image

    size = settings.lerobot["image_resolution"][0]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(settings.cameras):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def state(settings: Settings, seed: int) -> list[float]:
    return (torch.rand(settings.state_dim, generator=torch.Generator().manual_seed(seed)) * 2 - 1).tolist()


# ------------------------------------------------------------------------------ the floor
@dataclass(frozen=True)
class Pi05Roofline:
    """Parameter counts of the policy's parts and its bytes and FLOPs per phase."""

    config: Any  # mstar.model.pi05.config.Pi05Config
    vision_params: int  # SigLIP and the projector
    language_params: int  # the language model's layers and final norm (the embedding is a lookup)
    expert_params: int  # the expert's layers and norm, the action projections and the time MLP
    embedding_params: int
    size: int  # bytes per weight
    bandwidth_gbs: float
    tflops: float

    @classmethod
    def build(cls, lerobot: dict[str, Any], size: int, bandwidth_gbs: float, tflops: float) -> Pi05Roofline:
        from mstar.model.pi05.config import Pi05Config
        from mstar.model.pi05.modeling import Pi05Policy

        config = Pi05Config.from_lerobot(lerobot)
        with torch.device("meta"):
            policy = Pi05Policy(config)
        counts = {"vision": 0, "language": 0, "expert": 0, "embedding": 0}
        for name, p in policy.named_parameters():
            if "embed_tokens" in name:
                counts["embedding"] += p.numel()
            elif "vision_tower" in name or "multi_modal_projector" in name:
                counts["vision"] += p.numel()
            elif "language_model" in name:
                counts["language"] += p.numel()
            else:
                counts["expert"] += p.numel()
        return cls(config, counts["vision"], counts["language"], counts["expert"], counts["embedding"], size,
                   bandwidth_gbs, tflops)

    @property
    def total_params(self) -> int:
        return self.vision_params + self.language_params + self.expert_params + self.embedding_params

    def _kv_bytes(self, tokens: int) -> int:
        text = self.config.text
        return text.num_layers * 2 * text.num_kv_heads * text.head_dim * self.size * tokens

    def _attention_flops(self, dims, queries: int, keys: int) -> float:
        return 4.0 * queries * keys * dims.num_heads * dims.head_dim * dims.num_layers

    def prefix(self, batch: int, cameras: int, prompt_len: int) -> tuple[float, float]:
        """``(bytes, FLOPs)`` of the prefix phase of ``batch`` observations."""
        c, v = self.config, self.config.vision
        tpi, prefix = c.tokens_per_image, cameras * c.tokens_per_image + prompt_len
        vision_dims = type("V", (), {"num_heads": v.num_heads, "head_dim": v.hidden_size // v.num_heads,
                                     "num_layers": v.num_layers})
        flops = (2.0 * self.vision_params * batch * cameras * tpi
                 + self._attention_flops(vision_dims, tpi, tpi) * batch * cameras
                 + 2.0 * self.language_params * batch * prefix
                 + self._attention_flops(c.text, prefix, prefix) * batch)
        weights = (self.vision_params + self.language_params) * self.size
        return weights + self._kv_bytes(batch * prefix), flops

    def step(self, batch: int, prefix_len: int) -> tuple[float, float]:
        """``(bytes, FLOPs)`` of one denoise step of ``batch`` chunks after ``prefix_len`` tokens."""
        chunk = self.config.chunk_size
        flops = (2.0 * self.expert_params * batch * chunk
                 + self._attention_flops(self.config.expert, chunk, prefix_len + chunk) * batch)
        return self.expert_params * self.size + self._kv_bytes(batch * (prefix_len + chunk)), flops

    def seconds(self, phase: tuple[float, float]) -> float:
        moved, flops = phase
        return max(moved / (self.bandwidth_gbs * 1e9), flops / (self.tflops * 1e12))

    def chunk_s(self, batch: int, cameras: int, prompt_len: int, steps: int) -> dict[str, float]:
        """The floor of one batch: the prefix phase plus ``steps`` expert steps (seconds)."""
        prefix_len = cameras * self.config.tokens_per_image + prompt_len
        pre, step = self.prefix(batch, cameras, prompt_len), self.step(batch, prefix_len)
        return {"floor_s": self.seconds(pre) + steps * self.seconds(step), "prefix_s": self.seconds(pre),
                "step_s": self.seconds(step), "bytes": pre[0] + steps * step[0], "flops": pre[1] + steps * step[1]}


# ------------------------------------------------------------------------------- ours
class Ours:
    """A ``pi05`` deployment in this process; ``run(n)`` submits n observations at once."""

    def __init__(self, settings: Settings, policy_dir: Path, variant: dict[str, Any]):
        import mstar.model.pi05.model  # noqa: F401  (registers the family)
        from mstar.config import parse_config
        from mstar.runtime.launch import start

        self.settings = settings
        from mstar.model.pi05.config import Pi05Config

        prefix = settings.cameras * Pi05Config.from_lerobot(lerobot_config(settings)).tokens_per_image + 256
        pages = max(settings.batches) * -(-(prefix + settings.lerobot["chunk_size"]) // PAGE_SIZE) + 64
        kwargs: dict[str, Any] = {"seed": settings.seed, **variant}
        self.config = parse_config({
            "model": "pi05", "model_path": str(policy_dir), "load_format": "dummy", "device": settings.device,
            "dtype": str(settings.dtype).removeprefix("torch."), "max_concurrent_requests": max(settings.batches),
            "resources": {"kv_cache": {"max_num_pages": pages, "page_size": PAGE_SIZE}}, "model_kwargs": kwargs,
        }, "s10 config")
        t0 = time.perf_counter()
        self.deployment = start(self.config, in_process=True)
        self.startup_s = time.perf_counter() - t0
        self.images = camera_pngs(settings, settings.seed + 1)
        self.state = state(settings, settings.seed + 2)
        self.calls = 0
        # None: asyncio.to_thread's default executor, min(32, cores + 4) threads
        self.front = ThreadPoolExecutor(settings.front_threads)

    def run(self, n: int, timeout_s: float = 600.0) -> dict[str, Any]:
        """``n`` observations arriving at once: each through the front end, then all submitted
        together (see the module's docstring). The wall time from before the first front end
        until the last chunk, the front end's share of it, and each chunk's latency from then."""
        from mstar.contract import GenerateSpec

        self.calls += 1
        spec = self.deployment.spec
        specs = [GenerateSpec(f"s10-{self.calls}-{i}", TASK, [(f"cam{k}.png", img) for k, img in
                                                              enumerate(self.images)],
                              ["action"], {"state": self.state, "seed": i}) for i in range(n)]
        sinks = [TimedSink() for _ in specs]
        graphs_before = self.graph_keys()
        start = time.perf_counter()
        requests = list(self.front.map(spec.prepare_generate, specs))
        prepared = time.perf_counter()
        for s, request, sink in zip(specs, requests, sinks, strict=True):
            sink.submitted = start
            self.deployment.runtime.submit(s.request_id, request, spec.output_stream(request, []), sink)
        wait_all(sinks, timeout_s)
        ended = time.perf_counter()
        chunk_bytes = self.settings.lerobot["chunk_size"] * self.settings.lerobot["max_action_dim"] * 4
        for i, sink in enumerate(sinks):
            if sink.error or sink.data_bytes != chunk_bytes:
                raise RuntimeError(f"request {i}: error {sink.error!r}, {sink.data_bytes} bytes of action")
        return {"wall_s": ended - start, "front_s": prepared - start,
                "latency_s": [s.first_data - s.submitted for s in sinks],
                "captured": sorted(self.graph_keys() - graphs_before)}

    def graph_keys(self) -> set[str]:
        """The CUDA graphs the engine holds (``cuda_graphs``), as ``"prefill (rows, images,
        width)"`` / ``"step (rows, keys)"``: a run that captures one waits for the capture."""
        engine = self.deployment.runtime.workers.workers[0].engines["policy"]
        return {f"{name} {key}" for name, graphs in (("prefill", engine.prefill_graphs), ("step", engine.graphs))
                if graphs is not None for key in graphs.inputs}

    def prompt_len(self) -> int:
        from mstar.model.pi05.model import prompt_text

        return len(self.deployment.spec.tokenizer(prompt_text(TASK, torch.tensor(self.state))).input_ids)

    def close(self) -> None:
        self.front.shutdown()
        self.deployment.close()
        del self.deployment


def run_ours(settings: Settings, policy_dir: Path, name: str, variant: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    ours = Ours(settings, policy_dir, variant)
    out: dict[str, Any] = {"startup_s": ours.startup_s, "prompt_len": ours.prompt_len(), "warmup_s": {}}
    try:
        for n in settings.batches:  # the first batch of a size builds (and with compile, traces) its kernels
            w0 = time.perf_counter()
            ours.run(n)
            ours.run(n)
            out["warmup_s"][n] = time.perf_counter() - w0
        for n in settings.batches:
            runs = [ours.run(n) for _ in range(settings.runs)]
            wall = statistics.median(r["wall_s"] for r in runs)
            out[n] = {"wall_s": [r["wall_s"] for r in runs], "wall_ms_median": wall * 1e3,
                      "front_ms_median": 1e3 * statistics.median(r["front_s"] for r in runs),
                      "latency_ms_median": 1e3 * statistics.median(t for r in runs for t in r["latency_s"]),
                      "captured": [r["captured"] for r in runs],
                      # after the front end: what the baseline's time covers (preprocessed inputs)
                      "prepared_ms_median": 1e3 * statistics.median(r["wall_s"] - r["front_s"] for r in runs),
                      "chunks_per_s": n / wall}
            log.info("ours (%s) at %d: %.1f ms per batch, %.2f chunks/s", name, n, wall * 1e3, n / wall)
    finally:
        ours.close()
        free_device(settings.device)
    out["total_s"] = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------- baseline
class BaselineUnavailable(RuntimeError):
    """The installed transformers cannot run the baseline (the column is left empty)."""


def reference_classes() -> tuple[type, type]:
    """transformers' ``(PI05Config, PI05ForConditionalGeneration)``; ``BaselineUnavailable``
    where this transformers has none."""
    try:
        from transformers import PI05Config, PI05ForConditionalGeneration
    except ImportError as err:
        import transformers

        raise BaselineUnavailable(f"transformers {transformers.__version__} has no PI05ForConditionalGeneration: "
                                  "no baseline column") from err
    return PI05Config, PI05ForConditionalGeneration


def reference_config(config: Any):
    """transformers' ``PI05Config`` of the same shapes as our ``Pi05Config``."""
    PI05Config, _ = reference_classes()

    def gemma(dims) -> dict[str, Any]:
        return {"model_type": "gemma", "hidden_size": dims.hidden_size, "num_hidden_layers": dims.num_layers,
                "intermediate_size": dims.intermediate_size, "num_attention_heads": dims.num_heads,
                "num_key_value_heads": dims.num_kv_heads, "head_dim": dims.head_dim, "rms_norm_eps": dims.rms_norm_eps,
                "vocab_size": config.vocab_size}

    v = config.vision
    vision = {"model_type": "siglip_vision_model", "hidden_size": v.hidden_size,
              "intermediate_size": v.intermediate_size, "num_hidden_layers": v.num_layers,
              "num_attention_heads": v.num_heads, "image_size": v.image_size,
              "patch_size": v.patch_size, "layer_norm_eps": v.layer_norm_eps, "vision_use_head": False}
    vlm = {"model_type": "paligemma", "text_config": gemma(config.text), "vision_config": vision,
           "projection_dim": config.text.hidden_size, "image_token_id": config.vocab_size}
    return PI05Config(vlm_config=vlm, dit_config=gemma(config.expert), chunk_size=config.chunk_size,
                      max_action_dim=config.max_action_dim, num_inference_steps=config.num_inference_steps,
                      min_period=config.min_period, max_period=config.max_period)


def reference_name(name: str) -> str | None:
    """transformers' PI05 parameter name -> ours (the released lerobot layout)."""
    renames = (("model.vlm.vision_tower.", "paligemma_with_expert.paligemma.model.vision_tower.vision_model."),
               ("model.vlm.multi_modal_projector.", "paligemma_with_expert.paligemma.model.multi_modal_projector."),
               ("model.vlm.language_model.", "paligemma_with_expert.paligemma.model.language_model."),
               ("model.dit.", "paligemma_with_expert.gemma_expert.model."), ("embed_action_time.", ""),
               ("action_out_proj.", "action_out_proj."))
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return None


def build_reference(settings: Settings, policy_dir: Path):
    """transformers' policy on the device holding the weights of ours (the same seeded dummy
    weights, built again from the policy directory and copied in, every tensor both ways)."""
    from mstar.model.pi05.checkpoint import Pi05Checkpoint

    _, PI05ForConditionalGeneration = reference_classes()  # first: an old transformers skips at once
    device = torch.device(settings.device)
    checkpoint = Pi05Checkpoint(policy_dir)
    config = reference_config(checkpoint.config())
    ours = checkpoint.load_model(device, settings.dtype, dummy=True, seed=settings.seed)
    with torch.device(device):
        model = PI05ForConditionalGeneration(config).to(settings.dtype).eval()
    source = dict(ours.named_parameters())
    copied = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            ours_name = reference_name(name)
            if ours_name not in source:
                raise RuntimeError(f"the baseline's {name} has no counterpart in ours")
            param.copy_(source[ours_name])
            copied.add(ours_name)
    missing = sorted(set(source) - copied)
    if missing:
        raise RuntimeError(f"ours' {missing[:5]} were not copied into the baseline")
    return model, ours


def reference_inputs(settings: Settings, config: Any, prompt_ids: torch.Tensor, batch: int) -> dict[str, torch.Tensor]:
    """``batch`` copies of ours' observation preprocessed as ``sample_actions`` takes it: the
    same camera images in [-1, 1], image placeholder ids then the same prompt ids, fixed noise."""
    import numpy as np
    from PIL import Image

    device = torch.device(settings.device)
    frames = [torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy())
              for data in camera_pngs(settings, settings.seed + 1)]
    pixels = torch.stack(frames).permute(0, 3, 1, 2).float() / 255.0 * 2 - 1  # already the tower's size
    image_ids = torch.full((len(frames) * config.tokens_per_image,), config.vocab_size)
    ids = torch.cat([image_ids, prompt_ids])[None].expand(batch, -1)
    noise = torch.randn(batch, config.chunk_size, config.max_action_dim,
                        generator=torch.Generator().manual_seed(settings.seed + 3))
    return {"input_ids": ids.contiguous().to(device),
            "pixel_values": pixels[None].expand(batch, -1, -1, -1, -1).contiguous().to(device, settings.dtype),
            "attention_mask": torch.ones_like(ids).to(device),
            "pixel_attention_mask": torch.ones(batch, len(frames), dtype=torch.bool, device=device),
            "noise": noise.to(device, settings.dtype)}


def run_baseline(settings: Settings, policy_dir: Path, prompt_ids: torch.Tensor) -> dict[str, Any]:
    """``sample_actions`` per batch size: a warm-up, then ``runs`` timed calls (median); and how
    far its chunk is from ours' eager ``sample_actions`` of the same inputs (batch 1)."""
    device = torch.device(settings.device)
    t0 = time.perf_counter()
    model, ours = build_reference(settings, policy_dir)
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0, "compiled": settings.baseline_compile,
                           "attn_implementation": model.config._attn_implementation, "warmup_s": {}}
    try:
        config = ours.config
        with torch.inference_mode():
            inputs = reference_inputs(settings, config, prompt_ids, 1)
            want = ours.sample_actions(list(inputs["pixel_values"]), [prompt_ids.to(settings.device)],
                                       inputs["noise"].float(), page_size=PAGE_SIZE)
            got = model.sample_actions(**inputs).float()
            out["rel_err_vs_ours_eager"] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
            del ours
            free_device(settings.device)
            if settings.baseline_compile:
                model.compile()
            for n in settings.batches:
                inputs = reference_inputs(settings, config, prompt_ids, n)
                w0 = time.perf_counter()
                for _ in range(3 if settings.baseline_compile else 1):  # compiled: settles by the third
                    model.sample_actions(**inputs)
                synchronize(device)
                out["warmup_s"][n] = time.perf_counter() - w0
                times = []
                for _ in range(settings.runs):
                    synchronize(device)
                    s0 = time.perf_counter()
                    model.sample_actions(**inputs)
                    synchronize(device)
                    times.append(time.perf_counter() - s0)
                wall = statistics.median(times)
                out[n] = {"wall_s": times, "wall_ms_median": wall * 1e3, "chunks_per_s": n / wall}
                log.info("transformers%s at %d: %.1f ms per batch, %.2f chunks/s",
                         " (compiled)" if settings.baseline_compile else "", n, wall * 1e3, n / wall)
    finally:
        del model
        free_device(settings.device)
    out["total_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------- metrics
def metrics_from(settings: Settings, roof: Pi05Roofline, prompt_len: int, ours: dict[str, dict[str, Any]],
                 baseline: dict[str, Any] | None) -> list[Metric]:
    """Per ours variant: ``latency@1`` (ms/chunk) and, per larger N, ``chunks/s@N`` and
    ``actions/s@N``."""
    rows: list[Metric] = []
    chunk, steps = settings.lerobot["chunk_size"], settings.lerobot["num_inference_steps"]
    name = scenario_name(settings)
    for variant, result in (ours or {"(ours skipped)": {}}).items():
        for n in settings.batches:
            floor = roof.chunk_s(n, settings.cameras, prompt_len, steps)
            mine, theirs = result.get(n, {}), (baseline or {}).get(n, {})
            notes = {"floor_prefix_ms": floor["prefix_s"] * 1e3, "floor_step_ms": floor["step_s"] * 1e3,
                     "floor_gb_per_batch": floor["bytes"] / 1e9, "floor_tflop_per_batch": floor["flops"] / 1e12,
                     "prompt_tokens": prompt_len, "cameras": settings.cameras, "steps": steps,
                     "ours_is": f"pi05 deployment in process, {variant}: first front end to last chunk, "
                                "all N prepared, then submitted together",
                     "baseline_is": "transformers PI05ForConditionalGeneration.sample_actions"
                                    + (" (model.compile())" if settings.baseline_compile else " (eager)")
                                    + " on preprocessed inputs",
                     **{f"ours_{k}": v for k, v in mine.items()}, **{f"baseline_{k}": v for k, v in theirs.items()}}
            if n == 1:
                rows.append(Metric(name, f"latency@1 {variant}", "ms/chunk", "lower", ours=mine.get("wall_ms_median"),
                                   baseline=theirs.get("wall_ms_median"), floor=floor["floor_s"] * 1e3, notes=notes))
                continue
            rate = {k: r.get("chunks_per_s") for k, r in (("ours", mine), ("baseline", theirs))}
            rows.append(Metric(name, f"chunks/s@{n} {variant}", "chunk/s", "higher", ours=rate["ours"],
                               baseline=rate["baseline"], floor=n / floor["floor_s"], notes=notes))
            rows.append(Metric(name, f"actions/s@{n} {variant}", "action/s", "higher",
                               ours=rate["ours"] and rate["ours"] * chunk,
                               baseline=rate["baseline"] and rate["baseline"] * chunk,
                               floor=n * chunk / floor["floor_s"], notes=notes))
            prepared = mine.get("prepared_ms_median")
            rows.append(Metric(name, f"chunks/s@{n} {variant}, inputs prepared", "chunk/s", "higher",
                               ours=prepared and n / prepared * 1e3, baseline=rate["baseline"],
                               floor=n / floor["floor_s"], notes={**notes, "ours_is": (
                                   f"as chunks/s@{n} {variant}, from the last front end's end: the "
                                   "baseline's inputs are prepared before its clock starts too")}))
    return rows


# ------------------------------------------------------------------------------ main
def scenario_name(settings: Settings) -> str:
    return f"{SCENARIO} (smoke: tiny shapes, CPU)" if settings.smoke else SCENARIO


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the code paths)")
    p.add_argument("--batches", default=None, help="concurrent observations (default 1,16)")
    p.add_argument("--cameras", type=int, default=3, help="camera images per observation (1 to 3)")
    p.add_argument("--steps", type=int, default=None, help="Euler steps (default the config's, 10)")
    p.add_argument("--runs", type=int, default=None, help="timed batches per size, median (default 5)")
    p.add_argument("--compile", action="store_true",
                   help="also run ours with model_kwargs.compile (the expert's norms and MLPs compiled)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also run ours with model_kwargs.cuda_graphs (each denoise step from a CUDA graph)")
    p.add_argument("--baseline-compile", action="store_true", help="transformers' model with model.compile()")
    p.add_argument("--skip-ours", action="store_true", help="do not run M*")
    p.add_argument("--skip-eager", action="store_true", help="run only ours' fast-path variants asked for")
    p.add_argument("--front-threads", type=int, default=None,
                   help="threads preparing observations, as the YAML key prepare_threads "
                        "(default: asyncio's default executor)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run transformers")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(args)
    started = time.perf_counter()
    log.info("S10 settings: %s", settings.describe())
    bandwidth = measure_memory_bandwidth(settings.device)
    tflops = measure_matmul_tflops(settings.device, settings.dtype)
    size = torch.finfo(settings.dtype).bits // 8
    roof = Pi05Roofline.build(lerobot_config(settings), size, bandwidth, tflops)
    log.info("measured %.0f GB/s copy bandwidth, %.1f TFLOP/s %s matmul; %.2f B parameters", bandwidth, tflops,
             settings.dtype, roof.total_params / 1e9)

    errors: dict[str, str] = {}
    ours: dict[str, dict[str, Any]] = {}
    baseline = None
    with tempfile.TemporaryDirectory(prefix="s10-") as tmp:
        policy_dir = write_policy_dir(settings, Path(tmp) / "policy")
        tokenizer_ids = _prompt_ids(policy_dir, settings)
        for variant, kwargs in variants(settings) if not settings.skip_ours else []:
            try:
                ours[variant] = run_ours(settings, policy_dir, variant, kwargs)
            except Exception as err:
                log.exception("ours (%s) failed", variant)
                errors[f"ours {variant}"] = f"{type(err).__name__}: {err}"
        if not settings.skip_baseline:
            try:
                baseline = run_baseline(settings, policy_dir, tokenizer_ids)
            except BaselineUnavailable as err:  # an old transformers: the column stays empty
                log.warning("%s", err)
                baseline = {"unavailable": str(err)}
            except Exception as err:  # keep ours' numbers when the baseline cannot run
                log.exception("the baseline failed")
                errors["baseline"] = f"{type(err).__name__}: {err}"
    prompt_len = len(tokenizer_ids)
    metrics = metrics_from(settings, roof, prompt_len, ours, baseline)
    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"memory_bandwidth_gbs": bandwidth, "matmul_tflops": tflops,
                     "params": {"vision": roof.vision_params, "language": roof.language_params,
                                "expert": roof.expert_params, "embedding": roof.embedding_params,
                                "total": roof.total_params}},
        "metrics": metrics,
        "ours": _jsonable(ours),
        "baseline": _jsonable(baseline),
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S10 done in %.1f s%s", record["total_s"], f"; errors: {sorted(errors)}" if errors else "")
    return 1 if errors else 0


def variants(settings: Settings) -> list[tuple[str, dict[str, Any]]]:
    """Ours' deployments to run: eager, then each fast path asked for (``model_kwargs``)."""
    compiled = {"compile": True, "compile_backend": "inductor"}
    out: list[tuple[str, dict[str, Any]]] = [] if settings.skip_eager else [("eager", {})]
    if settings.compile:
        out.append(("compile", compiled))
    if settings.cuda_graphs:
        out.append(("graphs", {"cuda_graphs": True}))
    if settings.compile and settings.cuda_graphs:
        out.append(("graphs+compile", {"cuda_graphs": True, **compiled}))
    return out


def _prompt_ids(policy_dir: Path, settings: Settings) -> torch.Tensor:
    """The ids of the prompt every observation sends (as ours' front end tokenises it)."""
    from mstar.model.pi05.checkpoint import Pi05Checkpoint
    from mstar.model.pi05.model import prompt_text

    tokenizer = Pi05Checkpoint(policy_dir).tokenizer()
    text = prompt_text(TASK, torch.tensor(state(settings, settings.seed + 2)))
    return torch.tensor(tokenizer(text).input_ids, dtype=torch.int64)


def _jsonable(value: Any) -> Any:
    """Integer keys (batch sizes) as strings, for JSON."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    sys.exit(main())
