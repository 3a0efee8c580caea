"""The runs that need several GPUs (issue 33), one command each: every run starts its
deployments from the shipped ``configs/*.yaml`` (placement as shipped, sizes for the run,
``load_format: dummy`` over a weightless checkpoint folder at the released shapes) and
times them against the run's own baseline on the same machine.

    python benchmarks/multi_gpu.py --list                    # each run, the kind it needs, its estimated time
    python benchmarks/multi_gpu.py --runs llama_tp2          # one run (several: a comma list)
    python benchmarks/multi_gpu.py --kind nvidia-h200-x2     # every run of that kind
    python benchmarks/multi_gpu.py --smoke --runs llama_tp2  # the same code path on the CPU (gloo, tiny shapes)

Chat runs go through a real ``mstar serve`` (``benchmarks/http_load.py``): N concurrent
streaming chats, greedy, EOS ignored, prompts of random letters (one token each); the
figures are S1's (``s1_llama_decode.summarize``). Image runs post to
``/v1/images/generations``; the video run drives the runtime as S8 does
(``s8_wan22.run_ours``). Each run writes one JSON record (``$OUT``, ``--out`` or
benchmarks/results) and prints the table of ``common.write_record`` and a summary whose
ratio rows give the scaling efficiency: the speed-up over the baseline divided by the
GPUs added (TP=2 throughput over 2 x TP=1's).

A run whose GPU count the machine lacks is refused, naming the kind it needs. GLM-5.2 and
Command A+ keep their released widths but as many decoder layers as fit one card (the whole
model does not fit: ~1.5 TB of bf16 for GLM-5.2 over eight cards, ~437 GB for Command A+
over four 80 GB ones); the record says how many, and per-layer figures scale to the whole.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import logging
import os
import random
import string
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from benchmarks import multi_gpu_checkpoints as ckpts
from benchmarks.common import Metric, hardware, setup_logging, write_record

REPO = Path(__file__).resolve().parents[1]
KIND = {1: "nvidia-h200", 2: "nvidia-h200-x2", 4: "nvidia-h200-x4", 8: "nvidia-h200-x8"}
GiB = 1 << 30
CARD_RESERVE = 16 * GiB  # per card, beside the weights: KV pools, activations, the CUDA context
NO_MULTICAST = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")  # as gpu_checks.sh

log = logging.getLogger("multi_gpu")


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    smoke: bool
    streams: tuple[int, ...]  # concurrent chats of the decode rows
    prompt_len: int
    new_tokens: int
    runs: int  # timed batches per stream count (median throughput, pooled ITL and TTFT)
    warmup_tokens: int
    seed: int
    workdir: Path
    pd_prompt_len: int = 1024  # the disaggregation run's prompts: prefill is what it moves off the decoder
    layers: int | None = None  # GLM-5.2's and Command A+'s decoder layers (None: as many as fit a card)
    eager: bool = False  # no fast paths: the Llama runs' Triton attention and CUDA graphs, Qwen's Triton attention

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    @property
    def dtype(self) -> str:
        return "float32" if self.smoke else "bfloat16"

    def fast_paths(self, cuda_graphs: bool = True) -> dict[str, Any]:
        """The decode fast paths' ``model_kwargs`` (Triton paged attention, CUDA-graph decode
        steps) on CUDA unless ``eager``: gpu_checks.sh found the eager engine too slow at 64
        streams for one command. None on the CPU."""
        if self.smoke or self.eager:
            return {}
        return {"attention_backend": "triton"} | ({"cuda_graphs": True} if cuda_graphs else {})

    def describe(self) -> dict[str, Any]:
        return {"smoke": self.smoke, "streams": list(self.streams), "prompt_len": self.prompt_len,
                "new_tokens": self.new_tokens, "runs": self.runs, "warmup_tokens": self.warmup_tokens,
                "pd_prompt_len": self.pd_prompt_len, "layers": self.layers, "eager": self.eager, "seed": self.seed,
                "device": self.device, "dtype": self.dtype, "load_format": "dummy",
                "sampling": "greedy", "ignore_eos": True}


def deployment(settings: Settings, yaml_name: str, model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """``configs/<yaml_name>`` with the run's checkpoint folder, dummy weights and
    ``overrides`` (top-level keys replaced, ``model_kwargs`` and ``resources`` merged). With
    ``--smoke``: the CPU in float32, each split group on at most two ranks (gloo), CUDA-only
    knobs dropped."""
    raw = yaml.safe_load((REPO / "configs" / yaml_name).read_text())
    kwargs = {**raw.get("model_kwargs", {}), **overrides.pop("model_kwargs", {})}
    resources = {**raw.get("resources", {}), **overrides.pop("resources", {})}
    config = {**raw, "model_path": str(model_dir), "load_format": "dummy", **overrides,
              "model_kwargs": kwargs, "resources": resources}
    if settings.smoke:
        config.update(device="cpu", dtype="float32")
        config.pop("gpus", None)
        kwargs.pop("moe_kernel", None)  # the Triton kernels are CUDA's
        config["node_groups"] = [_two_ranks(g) for g in config.get("node_groups", [])]
    return config


def _two_ranks(group: dict[str, Any]) -> dict[str, Any]:
    """A node group on at most ranks 0 and 1, its TP/SP size cut to match (the smoke's gloo)."""
    group = dict(group, ranks=[r for r in group["ranks"] if r < 2] or [1])
    for key in ("tp_size", "sp_size"):
        if group.get(key, 1) > 1:
            group[key] = len(group["ranks"])
    return group


def pages(streams: int, tokens: int, page_size: int, slack: int = 8) -> int:
    """KV pages for ``streams`` sequences of ``tokens`` each, plus ``slack``."""
    return streams * -(-tokens // page_size) + slack


# ---------------------------------------------------------------------------- chat runs
def random_prompt(rng: random.Random, length: int) -> str:
    """``length`` random lowercase letters: one token each under the runs' tokenizers."""
    return "".join(rng.choices(string.ascii_lowercase, k=length))


def png_uri(side: int, seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def serve_chats(settings: Settings, label: str, config: dict[str, Any], streams: tuple[int, ...],
                image_side: int | None = None) -> dict[str, Any]:
    """One deployment behind ``mstar serve``: a warm-up batch per stream count, then
    ``settings.runs`` timed batches each, keyed by the stream count; with ``image_side`` the
    same again with an image of that many pixels a side in every chat, under ``"image"``."""
    from benchmarks.http_load import chat_body, run_chat_streams, serve_config
    from benchmarks.s1_llama_decode import summarize

    rng = random.Random(settings.seed)

    def body(tokens: int, image: str | None) -> dict[str, Any]:
        out = chat_body(random_prompt(rng, settings.prompt_len), tokens)
        if image:
            out["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": out["messages"][0]["content"]}]
        return out

    def batch(server, n: int, tokens: int, image: str | None):
        result = run_chat_streams(server.url, [body(tokens, image) for _ in range(n)])
        bad = result.errors() + [f"stream {i}: {s.completion_tokens} of {tokens} tokens"
                                 for i, s in enumerate(result.streams) if s.completion_tokens != tokens]
        bad += [f"stream {i}: {len(s.token_times)} text events" for i, s in enumerate(result.streams)
                if len(s.token_times) < 2]
        if bad:
            raise RuntimeError(f"{label}, {n} streams: {'; '.join(bad[:4])}\n{server.log_tail()}")
        return result

    def timed(server, image: str | None) -> dict[int, Any]:
        out = {}
        for n in streams:
            batch(server, n, settings.warmup_tokens, image)
        for n in streams:
            out[n] = summarize([batch(server, n, settings.new_tokens, image) for _ in range(settings.runs)],
                               settings.new_tokens)
            log.info("%s%s: %d stream(s): %.1f tok/s, ITL median %.2f ms, TTFT median %.1f ms", label,
                     " image" if image else "", n, out[n]["throughput_tok_s"], out[n]["inter_token_ms_median"],
                     out[n]["first_token_ms_median"])
        return out

    out: dict[str, Any] = {"config": config}
    t0 = time.perf_counter()
    with serve_config(config, settings.workdir / label) as server:
        out["startup_s"] = time.perf_counter() - t0
        log.info("%s: server ready in %.1f s", label, out["startup_s"])
        out.update(timed(server, None))
        if image_side:
            out["image"] = timed(server, png_uri(image_side, settings.seed))
    return out


def chat_rows(run: str, arms: dict[str, dict[str, Any]], streams: tuple[int, ...]) -> list[Metric]:
    """Per arm and stream count: throughput, median ITL and TTFT."""
    rows = []
    for label, result in arms.items():
        for n in streams:
            r = result[n]
            rows += [Metric(run, f"throughput@{n} {label}", "tok/s", "higher", r["throughput_tok_s"]),
                     Metric(run, f"itl@{n} {label}", "ms", "lower", r["inter_token_ms_median"],
                            notes={"p90": r["inter_token_ms_p90"]}),
                     Metric(run, f"ttft@{n} {label}", "ms", "lower", r["first_token_ms_median"],
                            notes={"p90": r["first_token_ms_p90"]})]
    return rows


def ratio(run: str, metric: str, unit: str, better: str, ours: float, baseline: float, gpus_added: float) -> Metric:
    """A row of ours against the baseline; for a rate the scaling efficiency is ours/baseline
    over ``gpus_added`` (the GPU-count ratio), for a time baseline/ours over it."""
    speedup = ours / baseline if better == "higher" else baseline / ours
    return Metric(run, metric, unit, better, ours, baseline,
                  notes={"speedup": speedup, "gpu_ratio": gpus_added, "scaling_efficiency": speedup / gpus_added})


# ------------------------------------------------------------------------ the runs (2 GPUs)
def llama_settings(settings: Settings, yaml_name: str, model_dir: Path, page_size: int, **overrides) -> dict:
    n = max(settings.streams)
    tokens = settings.prompt_len + settings.new_tokens
    return deployment(settings, yaml_name, model_dir, max_seq_len=tokens + 2 * page_size, max_concurrent_requests=n,
                      resources={"kv_cache": {"max_num_pages": pages(n, tokens, page_size), "page_size": page_size}},
                      model_kwargs=settings.fast_paths(), **overrides)


def llama_arms(settings: Settings, arms: dict[str, Any], yaml_name: str, page_size: int,
               placements: dict[str, dict[str, Any]], streams: tuple[int, ...]) -> None:
    """Each of ``placements`` (label -> placement keys over ``configs/<yaml_name>``) served
    in turn at Llama-3.1-8B shapes, its results under its label as soon as it is done."""
    model_dir = ckpts.llama_dir(settings.workdir / "llama", settings.smoke)
    for label, placement in placements.items():
        arms[label] = serve_chats(settings, label, llama_settings(settings, yaml_name, model_dir, page_size,
                                                                  **placement), streams)


ONE_GPU = {"gpus": [0], "node_groups": [{"node_names": ["llm"], "ranks": [0]}]}


def run_llama_tp2(settings: Settings, arms: dict[str, Any]) -> list[Metric]:
    llama_arms(settings, arms, "llama_tp2.yaml", 16, {"tp=1": ONE_GPU, "tp=2": {}}, settings.streams)
    run = "llama_tp2"
    rows = chat_rows(run, arms, settings.streams)
    for n in settings.streams:
        rows.append(ratio(run, f"tp=2 vs tp=1 throughput@{n}", "tok/s", "higher", arms["tp=2"][n]["throughput_tok_s"],
                          arms["tp=1"][n]["throughput_tok_s"], 2))
    low = min(settings.streams)
    rows.append(ratio(run, f"tp=2 vs tp=1 itl@{low}", "ms", "lower", arms["tp=2"][low]["inter_token_ms_median"],
                      arms["tp=1"][low]["inter_token_ms_median"], 2))
    return rows


def run_llama_dp2(settings: Settings, arms: dict[str, Any]) -> list[Metric]:
    two = {**ONE_GPU, "gpus": [0, 1], "replicas": 2}  # replica i takes GPU i
    llama_arms(settings, arms, "llama_tp2.yaml", 16, {"replicas=1": ONE_GPU, "replicas=2": two}, settings.streams)
    run = "llama_dp2"
    rows = chat_rows(run, arms, settings.streams)
    for n in settings.streams:
        rows.append(ratio(run, f"replicas=2 vs 1 throughput@{n}", "tok/s", "higher",
                          arms["replicas=2"][n]["throughput_tok_s"], arms["replicas=1"][n]["throughput_tok_s"], 2))
    return rows


def run_llama_pd(settings: Settings, arms: dict[str, Any]) -> list[Metric]:
    """Prefill on GPU 0 handing K/V to decode on GPU 1 (configs/llama_pd_disagg.yaml) against
    one engine that prefills and decodes on one GPU (no ``llm_prefill`` node: chats walk
    ``chat``), at the largest stream count, prompts of ``pd_prompt_len`` tokens."""
    n = max(settings.streams)
    settings = dataclasses.replace(settings, prompt_len=settings.pd_prompt_len)
    llama_arms(settings, arms, "llama_pd_disagg.yaml", 128, {"colocated": ONE_GPU, "pd": {"gpus": [0, 1]}}, (n,))
    run = "llama_pd"
    rows = chat_rows(run, arms, (n,))
    pd, co = arms["pd"][n], arms["colocated"][n]
    rows += [ratio(run, f"pd vs colocated ttft@{n}", "ms", "lower", pd["first_token_ms_median"],
                   co["first_token_ms_median"], 2),
             ratio(run, f"pd vs colocated itl@{n}", "ms", "lower", pd["inter_token_ms_median"],
                   co["inter_token_ms_median"], 2),
             ratio(run, f"pd vs colocated throughput@{n}", "tok/s", "higher", pd["throughput_tok_s"],
                   co["throughput_tok_s"], 2)]
    return rows


def run_flux2_cfg(settings: Settings, arms: dict[str, Any]) -> list[Metric]:
    """FLUX.2 klein base: CFG's two branches on two GPUs against the batched pair on one."""
    from benchmarks import s2_flux2_klein as s2
    from benchmarks.http_load import run_posts, serve_config

    s2s = s2.settings_from(s2.parse_args(["--smoke", "--http"] if settings.smoke else []))
    model_dir = s2.klein_dir(settings.workdir / "klein", s2s)
    side, steps = s2s.width, 4 if settings.smoke else 50
    concurrency = (1, 2) if settings.smoke else (1, 4)
    kwargs = {"max_image_area": side * side, "num_inference_steps": steps, "seed": settings.seed}
    body = {"prompt": s2.PROMPT, "size": f"{side}x{side}", "n": 1, "num_inference_steps": steps,
            "response_format": "b64_json"}

    def images(server, n: int, seed: int) -> float:
        """``n`` images posted at once: the wall time of all."""
        t = time.perf_counter()
        answers = run_posts(server.url, "/v1/images/generations", [body | {"seed": seed + i} for i in range(n)])
        wall = time.perf_counter() - t
        bad = [a.body[:300] for a in answers if a.status != 200]
        if bad:
            raise RuntimeError(f"{bad[0]!r}\n{server.log_tail()}")
        return wall

    for label, yaml_name in (("batched", "flux2_klein_base.yaml"),
                             ("cfg_parallel", "flux2_klein_base_cfg_parallel.yaml")):
        config = deployment(settings, yaml_name, model_dir, model_kwargs=dict(kwargs))
        out = arms[label] = {"config": config}
        t0 = time.perf_counter()
        with serve_config(config, settings.workdir / label) as server:
            out["startup_s"] = time.perf_counter() - t0
            for n in concurrency:
                images(server, n, 0)
            for n in concurrency:
                walls = sorted(images(server, n, 1000 * (i + 1)) for i in range(settings.runs))
                out[n] = {"s_per_image": walls[len(walls) // 2] / n, "wall_s": walls}
                log.info("%s: %d image(s) at once: %.3f s per image", label, n, out[n]["s_per_image"])
    run = "flux2_cfg"
    rows = []
    for n in concurrency:
        rows += [Metric(run, f"s/image@{n} {label}", "s", "lower", arms[label][n]["s_per_image"]) for label in arms]
        rows.append(ratio(run, f"cfg_parallel vs batched s/image@{n}", "s", "lower",
                          arms["cfg_parallel"][n]["s_per_image"], arms["batched"][n]["s_per_image"], 2))
    return rows


def run_wan22_sp2(settings: Settings, arms: dict[str, Any]) -> list[Metric]:
    """Wan2.2-TI2V-5B: the DiT over two GPUs by Ulysses SP against one GPU (S8's clips at
    832 x 480, 81 frames, 50 steps)."""
    from benchmarks import s8_wan22 as s8

    # 81 frames (5 s at 16 fps): SP pays where attention over the clip's tokens (8,190 here) dominates
    s8s = s8.settings_from(s8.parse_args(["--smoke", "--steps", "4"] if settings.smoke else ["--frames", "81"]))
    model_dir = s8.wan_dir(settings.workdir / "wan", s8s)
    for label, yaml_name in (("sp=1", "wan22.yaml"), ("sp=2", "wan22_sp2.yaml")):
        shipped = deployment(settings, yaml_name, model_dir)
        config = {**s8.deployment(s8s, model_dir), "node_groups": shipped["node_groups"]}
        if not settings.smoke:
            config["gpus"] = shipped["gpus"] if "gpus" in shipped else sorted({r for g in shipped["node_groups"]
                                                                              for r in g["ranks"]})
        arms[label] = {"config": config, **s8.run_ours(s8s, model_dir, config=config)}
    run = "wan22_sp2"
    rows = [Metric(run, f"s/step {label}", "s", "lower", arms[label]["s_per_step"]) for label in arms]
    rows += [Metric(run, f"s/clip {label}", "s", "lower", min(arms[label]["s_per_clip"])) for label in arms]
    rows.append(ratio(run, "sp=2 vs sp=1 s/step", "s", "lower", arms["sp=2"]["s_per_step"], arms["sp=1"]["s_per_step"],
                      2))
    return rows


# ---------------------------------------------------------------------- the runs (4, 8 GPUs)
def fitted_layers(settings: Settings, family: str, shapes: dict[str, Any], tp: int) -> int | None:
    """The decoder layers to build: all of them in the smoke, else as many as fit a card."""
    if settings.smoke or settings.layers:
        return settings.layers
    import torch

    card = torch.cuda.get_device_properties(0).total_memory
    return ckpts.layers_that_fit(family, shapes, tp, card, CARD_RESERVE)


def big_chat_run(settings: Settings, arms: dict[str, Any], run: str, yaml_name: str, model_dir: Path,
                 page_size: int, label: str, image_side: int | None = None, image_tokens: int = 0,
                 **overrides) -> list[Metric]:
    """One deployment: decode at each stream count, then (``image_side``) the same chats each
    carrying an image of ``image_tokens`` tokens or fewer."""
    n = max(settings.streams)
    tokens = settings.prompt_len + settings.new_tokens + image_tokens
    resources = {"kv_cache": {"max_num_pages": pages(n, tokens, page_size), "page_size": page_size},
                 **overrides.pop("resources", {})}
    config = deployment(settings, yaml_name, model_dir, max_seq_len=tokens + 2 * page_size, max_concurrent_requests=n,
                        resources=resources, **overrides)
    arms[label] = serve_chats(settings, label, config, settings.streams, image_side)
    chats = {label: arms[label]}
    if image_side:
        chats[f"{label} image"] = arms[f"{label} image"] = arms[label].pop("image")
    return chat_rows(run, chats, settings.streams)


def run_qwen3_8_tp4(settings: Settings, arms: dict[str, Any]) -> list[Metric]:
    """Qwen3.8-27B at TP4 (configs/qwen3_8_27b_tp4.yaml): text decode, and chats carrying one
    image of 1024 x 1024 (1,024 image tokens; smoke 64 x 64)."""
    model_dir = ckpts.qwen3_8_dir(settings.workdir / "qwen3_8", settings.smoke)
    side = 64 if settings.smoke else 1024
    n = max(settings.streams)
    # a patch of 16 (smoke 4) pixels, 2 x 2 patches merged into one token
    image_tokens = (side // (8 if settings.smoke else 32)) ** 2
    return big_chat_run(settings, arms, "qwen3_8_tp4", "qwen3_8_27b_tp4.yaml", model_dir, 16 if settings.smoke else 128,
                        "tp=4", image_side=side, image_tokens=image_tokens,
                        model_kwargs={"max_image_pixels": side * side, **settings.fast_paths(cuda_graphs=False)},
                        resources={"gdn_state": {"max_slots": n + 1, "state_dtype": "auto"}})


def run_command_a_tp4(settings: Settings, arms: dict[str, Any]) -> list[Metric]:
    layers = fitted_layers(settings, "command_a_plus", ckpts.COMMAND_A_PLUS, 4)
    arms["layers"] = {"built": layers or ckpts.COMMAND_TINY["num_hidden_layers"],
                      "released": ckpts.COMMAND_A_PLUS["num_hidden_layers"]}
    model_dir = ckpts.command_a_plus_dir(settings.workdir / "command_a_plus", settings.smoke, layers)
    return big_chat_run(settings, arms, "command_a_tp4", "command_a_plus_tp4.yaml", model_dir, 16, "tp=4")


def run_glm52_tp8(settings: Settings, arms: dict[str, Any]) -> list[Metric]:
    layers = fitted_layers(settings, "glm52", ckpts.GLM_5_2, 8)
    arms["layers"] = {"built": layers or ckpts.GLM_TINY["num_hidden_layers"],
                      "released": ckpts.GLM_5_2["num_hidden_layers"]}
    model_dir = ckpts.glm52_dir(settings.workdir / "glm52", settings.smoke, layers)
    return big_chat_run(settings, arms, "glm52_tp8", "glm52.yaml", model_dir, 16 if settings.smoke else 64, "tp=8",
                        model_kwargs={"max_prefill_tokens": 8192})


# ------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Run:
    name: str
    gpus: int
    minutes: float  # estimated wall time on the kind (not yet measured: no such machine was lent)
    measures: str
    fn: Callable[[Settings, dict[str, Any]], list[Metric]]  # fills the arms as each is done, returns the rows

    @property
    def kind(self) -> str:
        return KIND[self.gpus]


RUNS = [
    Run("llama_tp2", 2, 3, "Llama-3.1-8B shapes, TP=2 vs TP=1 over HTTP at 1 and 64 streams", run_llama_tp2),
    Run("llama_dp2", 2, 3, "Llama-3.1-8B shapes, 2 data-parallel replicas vs 1 at 1 and 64 streams", run_llama_dp2),
    Run("llama_pd", 2, 3, "Llama-3.1-8B shapes, 1024-token prompts: prefill/decode on two GPUs vs colocated, "
        "TTFT and ITL at 64 streams",
        run_llama_pd),
    Run("flux2_cfg", 2, 6, "FLUX.2 klein base 1024^2, 50 steps: CFG branches on two GPUs vs the batched pair",
        run_flux2_cfg),
    Run("wan22_sp2", 2, 5, "Wan2.2-TI2V-5B 832x480x81, 50 steps: Ulysses SP=2 vs SP=1, s/step and s/clip",
        run_wan22_sp2),
    Run("qwen3_8_tp4", 4, 5, "Qwen3.8-27B TP4 decode at 1 and 64 streams, and chats with one 1024^2 image",
        run_qwen3_8_tp4),
    Run("command_a_tp4", 4, 6, "Command A+ TP4 decode at 1 and 64 streams (layers that fit a card)",
        run_command_a_tp4),
    Run("glm52_tp8", 8, 9, "GLM-5.2 TP8 decode at 1 and 64 streams (layers that fit a card)", run_glm52_tp8),
]
BY_NAME = {r.name: r for r in RUNS}


def list_runs() -> str:
    lines = ["| run | kind | est. minutes | measures |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.kind} | {r.minutes:g} | {r.measures} |" for r in RUNS]
    return "\n".join(lines)


def pick(args: argparse.Namespace) -> list[Run]:
    if args.runs:
        unknown = [n for n in args.runs.split(",") if n not in BY_NAME]
        if unknown:
            raise SystemExit(f"--runs: unknown {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
        return [BY_NAME[n] for n in args.runs.split(",")]
    if args.kind:
        chosen = [r for r in RUNS if r.kind == args.kind]
        if not chosen:
            raise SystemExit(f"--kind {args.kind}: no run needs it; kinds: {', '.join(sorted({r.kind for r in RUNS}))}")
        return chosen
    raise SystemExit("name --runs or --kind (--list shows them)")


def refuse_missing_gpus(runs: list[Run], gpus: int) -> None:
    short = [r for r in runs if r.gpus > gpus]
    if short:
        raise SystemExit("; ".join(f"{r.name} needs {r.gpus} GPUs ({r.kind}), this machine has {gpus}"
                                   for r in short))


def summary_lines(run: Run, rows: list[Metric]) -> list[str]:
    """The record's ratio rows as markdown: value, baseline, speed-up, scaling efficiency."""
    lines = []
    for m in rows:
        if m.baseline is None:
            continue
        n = m.notes
        lines.append(f"| {run.name} | {m.metric} ({m.unit}) | {m.ours:.4g} | {m.baseline:.4g} | {n['speedup']:.3f} | "
                     f"{n['scaling_efficiency']:.3f} |")
    return lines


def measure(run: Run, settings: Settings, out_dir: str | None) -> dict[str, Any]:
    """Run ``run`` and write its record. A failure is recorded under ``errors``; a stop
    (SIGTERM from a time limit, Ctrl-C) writes the arms finished so far, then goes on up."""
    arms: dict[str, Any] = {}
    record: dict[str, Any] = {"run": run.name, "kind": run.kind, "gpus": run.gpus, "measures": run.measures,
                              "settings": settings.describe(), "hardware": hardware(), "arms": arms, "errors": {},
                              "metrics": [], "summary": []}
    name = f"multi_gpu_{run.name}" + ("_smoke" if settings.smoke else "")
    t0 = time.perf_counter()
    try:
        record["metrics"] = run.fn(settings, arms)
        record["summary"] = summary_lines(run, record["metrics"])
    except Exception as err:
        log.exception("%s failed", run.name)
        record["errors"][run.name] = f"{type(err).__name__}: {err}"
    except BaseException as stop:
        record["errors"][run.name] = f"stopped ({type(stop).__name__}) after {sorted(arms)}"
        record["wall_s"] = time.perf_counter() - t0
        write_record(name, record, out_dir)
        raise
    record["wall_s"] = time.perf_counter() - t0
    write_record(name, record, out_dir)
    log.info("%s: %.0f s", run.name, record["wall_s"])
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="print each run, the kind it needs and its estimated time")
    p.add_argument("--runs", default=None, help="comma list of run names")
    p.add_argument("--kind", default=None, help="every run of this machine kind")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, split groups on 2 gloo ranks")
    p.add_argument("--streams", default=None, help="stream counts (default 1,64; smoke 1,3)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; smoke 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per stream (default 128; smoke 6)")
    p.add_argument("--pd-prompt-len", type=int, default=None, help="llama_pd's prompt tokens (default 1024; smoke 24)")
    p.add_argument("--layers", type=int, default=None,
                   help="GLM-5.2's and Command A+'s decoder layers (default: as many as fit one card)")
    p.add_argument("--eager", action="store_true",
                   help="no fast paths (Llama: Triton attention and CUDA graphs; Qwen3.8: Triton attention)")
    p.add_argument("--batches", type=int, default=None, help="timed batches per stream count (default 2; smoke 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory of the JSON records (default $OUT, else benchmarks/results)")
    p.add_argument("--verbose", action="store_true", help="log M* at INFO level")
    args = p.parse_args(argv)
    if args.list:
        print(list_runs())
        return 0
    setup_logging(args.verbose)
    runs = pick(args)
    if not args.smoke:
        import torch

        for name in NO_MULTICAST:  # the lent machines' rule, inherited by every server the runs start
            os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
        refuse_missing_gpus(runs, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    streams = tuple(sorted({int(s) for s in args.streams.split(",")})) if args.streams else (
        (1, 3) if args.smoke else (1, 64))
    failed = 0
    summary = ["| run | metric | value | baseline | speed-up | scaling efficiency |", "|---|---|---|---|---|---|"]
    for run in runs:
        with tempfile.TemporaryDirectory(prefix=f"multi-gpu-{run.name}-") as tmp:
            settings = Settings(smoke=args.smoke, streams=streams,
                                prompt_len=args.prompt_len or (8 if args.smoke else 128),
                                new_tokens=args.new_tokens or (6 if args.smoke else 128),
                                runs=args.batches or (1 if args.smoke else 2), warmup_tokens=4 if args.smoke else 16,
                                seed=args.seed, workdir=Path(tmp),
                                pd_prompt_len=args.pd_prompt_len or (24 if args.smoke else 1024), layers=args.layers,
                                eager=args.eager)
            record = measure(run, settings, args.out)
            summary += record["summary"]
            failed += bool(record["errors"])
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
