"""S9: Qwen3-Omni-30B-A3B: the sparse MoE layer and thinker decode, against transformers.

The thinker's text decoder at the released shapes (``thinker_config.text_config`` of
Qwen/Qwen3-Omni-30B-A3B-Instruct: 48 layers, hidden 2048, 32 query heads and 4 KV heads of 128,
every MLP a sparse MoE of 128 experts of width 768, top-8 with ``norm_topk_prob``, vocabulary
152064, untied head), bf16 on one GPU, random weights. Two parts (``--parts moe,decode``):

* **moe**: one ``SparseMoE`` forward (router, top-8, experts) over T tokens of random hidden
  states, T in 1 ... 8192. ``ours`` runs the experts with each kernel of ``MoEExperts``: the
  per-expert ``loop``, ``grouped_mm`` (``torch._grouped_mm``) and ``triton``
  (``mstar.layers.triton_moe.triton_fused_moe``; skipped, with a note, where that module is
  missing). ``baseline`` is transformers' ``Qwen3OmniMoeThinkerTextSparseMoeBlock`` holding the
  same weights, with the experts implementation a model gets by default (``grouped_mm``); its
  ``eager`` loop is timed too (notes). Every ours output is compared with transformers' loop (max
  error over max magnitude). CUDA-event times, median of ``--moe-runs`` after a warm-up.
  Floor: the experts the tokens hit (distinct experts x 3 x H x I weights) read once at the
  measured bandwidth, or the routed FLOPs (2 x T x k x 3 x H x I) at the measured matmul rate,
  whichever is longer.
* **decode**: 128-token prompts of random text ids, 128 new tokens each (EOS ignored, greedy),
  1 stream and a batch of 8. ``ours`` is the thinker's text decoder
  (``Qwen3OmniThinkerForCausalLM``) on the autoregressive engine in this process (prefill of
  the whole batch, then one ``engine.run`` per decode step; no scheduler, no detokenising),
  once per experts kernel of ``--decode-kernels`` and, with ``--fused``, with the thinker's
  ``use_fused_kernels(True)``. A deployment is not used: it builds the whole thinker in
  float32 first (120 GB at 48 layers). ``baseline`` is transformers'
  ``Qwen3OmniMoeThinkerForConditionalGeneration`` (audio and vision towers shrunk: a text
  request never runs them) with random weights, ``generate`` with its default dynamic cache
  (``--baseline-static``: the static cache, which transformers compiles). The two models are
  never resident together (30.5 B parameters are 61 GB in bf16): each is built on the GPU in
  bf16, measured and freed in turn. ``--layers N`` builds N decoder layers instead of 48 (the
  record says so; decode time scales with the layers).
  ``latency@1`` is ours' median decode step at one stream, and transformers'
  (generate(128) - generate(1)) / 127 (the quickest call of each); ``throughput@N`` is N x 128
  tokens over the (median) wall time of the batch, prefill included. Floor per decode step:
  the weights the step touches (attention, router, norms, lm_head and the experts its tokens
  are expected to hit under uniform routing) plus the KV cache read at the measured bandwidth,
  or its FLOPs at the matmul rate; the batch adds its prefill (all experts read, or its FLOPs).

``--smoke`` runs the same code paths with tiny shapes in float32 on the CPU in seconds.
See benchmarks/README.md for the command lines.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
    measure_memory_bandwidth,
    setup_logging,
    synchronize,
    time_calls,
    write_record,
)

NAME = "s9_qwen3_omni"
SCENARIO = "S9 qwen3-omni-30B-A3B"
PAGE_SIZE = 16
FIRST_SPECIAL_ID = 151643  # Qwen's special and media tokens start here: prompts stay below it
KERNELS = ("loop", "grouped_mm", "triton")

log = logging.getLogger("s9")

# thinker_config.text_config of Qwen/Qwen3-Omni-30B-A3B-Instruct (transformers' key names)
THINKER_TEXT: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rms_norm_eps": 1e-6, "max_position_embeddings": 65536, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
                        "interleaved": True, "mrope_interleaved": True},
}
TINY_TEXT: dict[str, Any] = {
    **THINKER_TEXT, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32,
    "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 2048,
    "rope_parameters": {**THINKER_TEXT["rope_parameters"], "mrope_section": [4, 2, 2]},
}
# thinker_config's media token ids (transformers' rope index reads them even for text)
MEDIA_IDS = {"audio_token_id": 151646, "image_token_id": 151655, "video_token_id": 151656,
             "audio_start_token_id": 151647, "vision_start_token_id": 151652, "position_id_per_seconds": 25}
# transformers builds the thinker with its towers; a text request never runs them, so they are tiny
TINY_AUDIO = {"num_mel_bins": 16, "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2,
              "encoder_ffn_dim": 48, "n_window": 50, "n_window_infer": 200, "downsample_hidden_size": 8,
              "conv_chunksize": 50, "max_source_positions": 100}
TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 4,
               "spatial_merge_size": 2, "temporal_patch_size": 2, "deepstack_visual_indexes": [0]}


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """Everything one run depends on (recorded in the JSON)."""

    smoke: bool
    device: str
    dtype: torch.dtype
    parts: tuple[str, ...]
    text: dict[str, Any]  # the thinker's text config (transformers' keys), layers as run
    # moe
    moe_tokens: tuple[int, ...]
    moe_kernels: tuple[str, ...]
    moe_runs: int
    baseline_experts: str
    # decode
    prompt_len: int
    new_tokens: int
    batches: tuple[int, ...]
    decode_runs: int
    baseline_runs: int
    warmup_tokens: int
    decode_kernels: tuple[str, ...]
    fused: bool
    cuda_graphs: bool
    attention_backend: str
    baseline_static: bool
    skip_ours: bool
    skip_baseline: bool
    seed: int

    @property
    def layers(self) -> int:
        return self.text["num_hidden_layers"]

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len + self.new_tokens + PAGE_SIZE

    @property
    def kv_pages(self) -> int:
        return max(self.batches) * -(-self.max_seq_len // PAGE_SIZE)

    def describe(self) -> dict[str, Any]:
        return {
            "smoke": self.smoke, "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
            "parts": list(self.parts), "text_config": self.text, "layers": self.layers,
            "layers_released": THINKER_TEXT["num_hidden_layers"], "moe_tokens": list(self.moe_tokens),
            "moe_kernels": list(self.moe_kernels), "moe_runs": self.moe_runs,
            "baseline_experts": self.baseline_experts, "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens, "batches": list(self.batches), "decode_runs": self.decode_runs,
            "baseline_runs": self.baseline_runs, "warmup_tokens": self.warmup_tokens,
            "decode_kernels": list(self.decode_kernels), "fused": self.fused, "cuda_graphs": self.cuda_graphs,
            "attention_backend": self.attention_backend, "baseline_static_cache": self.baseline_static,
            "sampling": "greedy", "ignore_eos": True, "seed": self.seed, "page_size": PAGE_SIZE,
            "kv_cache_pages": self.kv_pages,
        }


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted({int(t) for t in text.split(",")})) if text else default


def _names(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; choose from {', '.join(allowed)}")
    return names


def settings_from(args: argparse.Namespace) -> Settings:
    if args.smoke:
        device, dtype, text = "cpu", torch.float32, dict(TINY_TEXT)
        tokens, prompt_len, new_tokens, batches = (1, 8, 32), 8, 6, (1, 2)
        runs = dict(moe=args.moe_runs or 3, decode=args.decode_runs or 1, baseline=args.baseline_runs or 2)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("S9 needs a CUDA GPU; use --smoke to run the tiny configuration on the CPU")
        device, dtype, text = "cuda", torch.bfloat16, dict(THINKER_TEXT)
        tokens, prompt_len, new_tokens, batches = (1, 8, 32, 128, 512, 2048, 8192), 128, 128, (1, 8)
        runs = dict(moe=args.moe_runs or 20, decode=args.decode_runs or 2, baseline=args.baseline_runs or 2)
    if args.layers is not None:
        if args.layers < 1:
            raise SystemExit("--layers must be at least 1")
        text["num_hidden_layers"] = args.layers
    prompt_len, new_tokens = args.prompt_len or prompt_len, args.new_tokens or new_tokens
    if new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (latency is measured between tokens)")
    return Settings(
        smoke=args.smoke, device=device, dtype=dtype, parts=_names(args.parts, ("moe", "decode"), "--parts"),
        text=text, moe_tokens=_ints(args.moe_tokens, tokens), moe_kernels=_names(args.moe_kernels, KERNELS,
                                                                                 "--moe-kernels"),
        moe_runs=runs["moe"], baseline_experts=args.baseline_experts, prompt_len=prompt_len,
        new_tokens=new_tokens, batches=_ints(args.batches, batches), decode_runs=runs["decode"],
        baseline_runs=runs["baseline"], warmup_tokens=min(args.warmup_tokens, new_tokens),
        decode_kernels=_names(args.decode_kernels, KERNELS, "--decode-kernels"), fused=args.fused,
        cuda_graphs=args.cuda_graphs,
        attention_backend=args.attention_backend, baseline_static=args.baseline_static,
        skip_ours=args.skip_ours, skip_baseline=args.skip_baseline, seed=args.seed,
    )


@contextmanager
def built_on(device: str, dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside are allocated on ``device`` in ``dtype`` (no float32 copy, no host
    init); computed buffers that ask for float32 (RoPE frequencies) keep it."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)


def free_device(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        log.info("freed: %.1f GB of GPU memory still allocated", torch.cuda.memory_allocated() / 1e9)


# --------------------------------------------------------------------- experts kernels
class KernelUnavailable(RuntimeError):
    """An experts kernel this tree or this machine cannot run (the column is skipped)."""


def triton_available(device: str) -> None:
    """Raise ``KernelUnavailable`` unless ``mstar.layers.triton_moe`` exists and can run here."""
    if importlib.util.find_spec("mstar.layers.triton_moe") is None:
        raise KernelUnavailable("mstar.layers.triton_moe is not in this tree")
    if device != "cuda" and not _interpreting():
        raise KernelUnavailable("Triton needs CUDA, or its interpreter (TRITON_INTERPRET=1 set before triton's "
                                "first import in this process)")


def _interpreting() -> bool:
    """Whether our kernels and Triton itself run under Triton's CPU interpreter in this process
    (the variable set after Triton's first import, e.g. by another test, is not enough)."""
    from mstar.layers.triton_support import INTERPRET, triton

    return INTERPRET and type(triton.language.zeros).__name__ == "InterpretedFunction"


def set_experts_kernel(model: torch.nn.Module, kernel: str) -> None:
    """Run every ``MoEExperts`` of ``model`` with ``kernel``: its ``kernel`` switch where the tree
    has one, else the older ``grouped_mm`` flag (which knows no Triton)."""
    from mstar.layers.moe import MoEExperts

    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    if kernel == "triton":
        triton_available(next(model.parameters()).device.type)
    if hasattr(MoEExperts, "kernel"):
        for m in experts:
            m.kernel = kernel
    elif kernel == "triton":
        raise KernelUnavailable("MoEExperts has no `kernel` switch in this tree")
    else:
        for m in experts:
            m.grouped_mm = kernel == "grouped_mm"


# ------------------------------------------------------------------------------- moe
def moe_floor_s(tokens: int, distinct: int, text: dict[str, Any], size: int, bandwidth_gbs: float,
                tflops: float) -> tuple[float, float, float]:
    """``(floor, weight-read time, FLOP time)`` in seconds of one MoE forward: the ``distinct``
    experts' weights read once, or ``tokens x top_k`` routed SwiGLUs at the matmul rate."""
    expert = 3 * text["hidden_size"] * text["moe_intermediate_size"]
    read = distinct * expert * size / (bandwidth_gbs * 1e9)
    flops = 2.0 * tokens * text["num_experts_per_tok"] * expert / (tflops * 1e12)
    return max(read, flops), read, flops


def build_moe_pair(settings: Settings):
    """Ours (``SparseMoE``, seeded random weights drawn on the device) and transformers' thinker
    sparse block holding the same weights."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextSparseMoeBlock

    from mstar.layers.moe import SparseMoE
    from mstar.model.weights import init_dummy_weights

    t = settings.text
    shape = dict(hidden_size=t["hidden_size"], moe_intermediate_size=t["moe_intermediate_size"],
                 num_experts=t["num_experts"], num_experts_per_tok=t["num_experts_per_tok"],
                 norm_topk_prob=t["norm_topk_prob"])
    with built_on(settings.device, settings.dtype):
        ours = SparseMoE(t["hidden_size"], t["moe_intermediate_size"], t["num_experts"], t["num_experts_per_tok"],
                         t["norm_topk_prob"])
        theirs = Qwen3OmniMoeThinkerTextSparseMoeBlock(Qwen3OmniMoeTextConfig(**shape, hidden_act="silu"))
    init_dummy_weights(ours, seed=settings.seed)
    with torch.no_grad():
        for mine, their in ((ours.gate.weight, theirs.gate.weight),
                            (ours.experts.gate_up.weight, theirs.experts.gate_up_proj),
                            (ours.experts.down.weight, theirs.experts.down_proj)):
            if mine.shape != their.shape:
                raise RuntimeError(f"transformers' {tuple(their.shape)} against ours {tuple(mine.shape)}")
            their.copy_(mine)
    synchronize(torch.device(settings.device))
    return ours.eval(), theirs.eval()


def ours_moe_call(ours, kernel: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """ours' forward with ``kernel``: the module's own switch, or for ``triton`` on a tree without
    one, the same routing then ``triton_fused_moe`` on the stacked weights."""
    from mstar.layers.moe import MoEExperts, route_topk

    if kernel != "triton" or hasattr(MoEExperts, "kernel"):
        set_experts_kernel(ours, kernel)
        return ours
    triton_available(ours.gate.weight.device.type)
    from mstar.layers.triton_moe import triton_fused_moe

    def forward(x: torch.Tensor) -> torch.Tensor:
        ids, weights = route_topk(ours.gate(x), ours.top_k, ours.normalize)
        return triton_fused_moe(x, ids, weights, ours.experts.gate_up.weight, ours.experts.down.weight)

    return forward


def run_moe(settings: Settings, bandwidth: float, tflops: float) -> dict[str, Any]:
    """Per token count: ours per kernel and transformers per experts implementation (ms), ours'
    errors against transformers' eager loop, the distinct experts hit and the floor."""
    t0 = time.perf_counter()
    ours, theirs = build_moe_pair(settings)
    device = torch.device(settings.device)
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0, "skipped": {}, "errors": {}, "by_tokens": {}}
    log.info("moe: built ours and transformers' block in %.1f s", out["build_s"])
    size = torch.finfo(settings.dtype).bits // 8
    generator = torch.Generator(device=device).manual_seed(settings.seed + 7)
    kernels = []
    for kernel in settings.moe_kernels:
        try:
            ours_moe_call(ours, kernel)
            kernels.append(kernel)
        except KernelUnavailable as err:
            log.warning("moe: ours' %s column skipped: %s", kernel, err)
            out["skipped"][kernel] = str(err)
    impls = list(dict.fromkeys((settings.baseline_experts, "eager")))
    try:
        with torch.inference_mode():
            for tokens in settings.moe_tokens:
                x = torch.randn(tokens, settings.text["hidden_size"], device=device, generator=generator,
                                dtype=torch.float32).to(settings.dtype)
                out["by_tokens"][tokens] = _moe_at(settings, ours, theirs, kernels, impls, x, size, bandwidth,
                                                   tflops, out["errors"])
    finally:
        del ours, theirs
        free_device(settings.device)
    return out


def _moe_at(settings: Settings, ours, theirs, kernels: list[str], impls: list[str], x: torch.Tensor,
            size: int, bandwidth: float, tflops: float, errors: dict[str, str]) -> dict[str, Any]:
    from mstar.layers.moe import route_topk

    tokens = x.shape[0]
    ids, _ = route_topk(ours.gate(x), settings.text["num_experts_per_tok"], settings.text["norm_topk_prob"])
    distinct = int(torch.unique(ids).numel())
    floor, read, flop = moe_floor_s(tokens, distinct, settings.text, size, bandwidth, tflops)
    row: dict[str, Any] = {"distinct_experts": distinct, "floor_ms": floor * 1e3, "floor_read_ms": read * 1e3,
                           "floor_flops_ms": flop * 1e3, "ours_ms": {}, "baseline_ms": {}, "ours_rel_err": {}}
    reference = None
    for impl in impls:
        theirs.experts.config._experts_implementation = impl
        try:
            result = theirs(x[None])[0]
            row["baseline_ms"][impl] = _median_ms(lambda: theirs(x[None]), settings)
        except Exception as err:  # an implementation this transformers or torch lacks: the others stand
            log.exception("moe: transformers' %s experts at T=%d failed", impl, tokens)
            errors[f"baseline {impl} T={tokens}"] = f"{type(err).__name__}: {err}"
            continue
        if impl == "eager":
            reference = result.float()
    for kernel in kernels:
        forward = ours_moe_call(ours, kernel)
        try:
            got = forward(x).float()
            row["ours_ms"][kernel] = _median_ms(lambda f=forward: f(x), settings)
        except Exception as err:
            log.exception("moe: ours' %s kernel at T=%d failed", kernel, tokens)
            errors[f"ours {kernel} T={tokens}"] = f"{type(err).__name__}: {err}"
            continue
        if reference is not None:
            row["ours_rel_err"][kernel] = float((got - reference).abs().max() / reference.abs().max().clamp_min(1e-30))
    tolerance = 1e-4 if settings.dtype == torch.float32 else 3e-2
    row["tolerance"] = tolerance
    bad = {k: e for k, e in row["ours_rel_err"].items() if not e <= tolerance}
    if bad:
        errors[f"moe mismatch T={tokens}"] = f"ours vs transformers' eager loop, max error / max |ref|: {bad}"
    log.info("moe T=%d: %d experts hit; ours %s ms; transformers %s ms; floor %.3f ms; errors %s", tokens, distinct,
             _fmt_ms(row["ours_ms"]), _fmt_ms(row["baseline_ms"]), floor * 1e3,
             {k: f"{e:.1e}" for k, e in row["ours_rel_err"].items()})
    return row


def _median_ms(op: Callable[[], Any], settings: Settings) -> float:
    return statistics.median(time_calls(op, settings.device, settings.moe_runs, warmup=3)) * 1e3


def _fmt_ms(times: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in times.items()) or "-"


def moe_metrics(settings: Settings, moe: dict[str, Any]) -> list[Metric]:
    """One row per token count and ours' kernel; the baseline column is transformers' block
    with ``baseline_experts`` (its eager loop's time is in the notes)."""
    rows = []
    for tokens, r in moe["by_tokens"].items():
        for kernel in settings.moe_kernels:
            if kernel in moe["skipped"]:
                continue
            row = Metric(scenario_name(settings), f"moe@{tokens} {kernel}", "ms", "lower",
                         ours=r["ours_ms"].get(kernel), baseline=r["baseline_ms"].get(settings.baseline_experts),
                         floor=r["floor_ms"])
            row.notes.update(tokens=tokens, distinct_experts=r["distinct_experts"],
                             floor_read_ms=r["floor_read_ms"], floor_flops_ms=r["floor_flops_ms"],
                             rel_err_vs_transformers_eager=r["ours_rel_err"].get(kernel),
                             baseline_is=f"transformers Qwen3OmniMoeThinkerTextSparseMoeBlock, "
                                         f"experts_implementation={settings.baseline_experts}",
                             baseline_ms_by_implementation=r["baseline_ms"])
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------- decode
@dataclass(frozen=True)
class ThinkerRoofline:
    """The thinker's least time per step and per batch from its shapes and the measured bandwidth
    and matmul rate. Experts a step touches: under uniform routing, ``E (1 - (1 - k/E)^n)`` of
    them for ``n`` tokens."""

    text: dict[str, Any]
    size: int
    bandwidth_gbs: float
    matmul_tflops: float

    @property
    def _attn_params(self) -> int:
        t = self.text
        q, kv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
        return t["hidden_size"] * (2 * q + 2 * kv)  # q, o; k, v

    @property
    def _expert_params(self) -> int:
        return 3 * self.text["hidden_size"] * self.text["moe_intermediate_size"]

    @property
    def _dense_params(self) -> int:
        """Per-step weights besides the experts: attention, router and norms of every layer, the
        final norm and the lm_head (the embedding rows read are counted apart)."""
        t = self.text
        per_layer = self._attn_params + t["num_experts"] * t["hidden_size"] + 2 * t["hidden_size"] + 2 * t["head_dim"]
        return t["num_hidden_layers"] * per_layer + t["hidden_size"] + t["vocab_size"] * t["hidden_size"]

    def experts_hit(self, tokens: int) -> float:
        e, k = self.text["num_experts"], self.text["num_experts_per_tok"]
        return e * (1.0 - (1.0 - k / e) ** tokens)

    @property
    def kv_bytes_per_position(self) -> int:
        t = self.text
        return 2 * t["num_hidden_layers"] * t["num_key_value_heads"] * t["head_dim"] * self.size

    def weight_bytes(self, tokens: int) -> float:
        """Weights a forward of ``tokens`` tokens reads (embedding rows included)."""
        t = self.text
        experts = t["num_hidden_layers"] * self.experts_hit(tokens) * self._expert_params
        return (self._dense_params + experts + tokens * t["hidden_size"]) * self.size

    def flops_per_token(self, lm_head: bool = True) -> float:
        t = self.text
        routed = t["num_experts_per_tok"] * self._expert_params
        per_layer = self._attn_params + t["num_experts"] * t["hidden_size"] + routed
        return 2.0 * (t["num_hidden_layers"] * per_layer + (t["vocab_size"] * t["hidden_size"] if lm_head else 0))

    @property
    def attn_flops_per_position(self) -> float:
        t = self.text
        return 4.0 * t["num_hidden_layers"] * t["num_attention_heads"] * t["head_dim"]

    def _bound(self, nbytes: float, flops: float) -> float:
        return max(nbytes / (self.bandwidth_gbs * 1e9), flops / (self.matmul_tflops * 1e12))

    def step_s(self, streams: int, context: int) -> float:
        """One decode step of ``streams`` sequences with ``context`` cached positions each."""
        nbytes = self.weight_bytes(streams) + streams * context * self.kv_bytes_per_position
        flops = streams * (self.flops_per_token() + context * self.attn_flops_per_position)
        return self._bound(nbytes, flops)

    def prefill_s(self, streams: int, prompt_len: int) -> float:
        tokens, head = streams * prompt_len, 2.0 * self.text["vocab_size"] * self.text["hidden_size"]
        attention = streams * prompt_len * (prompt_len + 1) / 2 * self.attn_flops_per_position
        flops = tokens * self.flops_per_token(lm_head=False) + streams * head + attention
        return self._bound(self.weight_bytes(tokens) + tokens * self.kv_bytes_per_position, flops)

    def decode_s(self, streams: int, prompt_len: int, steps: int) -> float:
        return sum(self.step_s(streams, prompt_len + k) for k in range(1, steps + 1))


def random_prompts(settings: Settings, streams: int, length: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``streams`` prompts of random text ids (below Qwen's special and media ids)."""
    high = min(settings.text["vocab_size"], FIRST_SPECIAL_ID)
    return [torch.randint(0, high, (length,), generator=generator) for _ in range(streams)]


def build_ours_thinker(settings: Settings):
    """The thinker's text decoder at the settings' shapes, seeded random weights drawn on the device."""
    from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig
    from mstar.model.qwen3_omni.modeling import Qwen3OmniThinkerForCausalLM
    from mstar.model.weights import init_dummy_weights

    with built_on(settings.device, settings.dtype):
        model = Qwen3OmniThinkerForCausalLM(Qwen3OmniTextConfig.from_hf_dict(thinker_config(settings)))
    init_dummy_weights(model, seed=settings.seed)
    synchronize(torch.device(settings.device))  # the draws are queued: count them in the build
    return model.eval()


def ours_engine(settings: Settings, model, cuda_graphs: bool = False):
    """The decode engine; ``cuda_graphs``: decode steps replay captured graphs (the engine's
    ``cuda_graphs`` knob, which runs the Triton attention)."""
    from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout

    graphs = cuda_graphs and torch.device(settings.device).type == "cuda"
    return AutoregressiveEngine(model, KVLayout(*model.cache_shape()), num_pages=settings.kv_pages,
                                page_size=PAGE_SIZE, max_seq_len=settings.max_seq_len,
                                device=torch.device(settings.device), dtype=settings.dtype,
                                attention_backend="triton" if graphs else settings.attention_backend,
                                cuda_graphs=graphs)


def ours_batch(engine, prompts: list[torch.Tensor], new_tokens: int, tag: str) -> dict[str, Any]:
    """Prefill ``prompts`` as one step, then ``new_tokens - 1`` decode steps of all of them;
    wall times (each step ends with its tokens on the host)."""
    from mstar.engine.base import EngineItem

    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": new_tokens, "stop_token_ids": []}
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    try:
        outs = engine.run([EngineItem(rid, "prefill", 0, {"prompt_ids": p}, params) for rid, p in zip(ids, prompts)])
        prefill_s = time.perf_counter() - start
        steps = []
        for step in range(1, new_tokens):
            began = time.perf_counter()
            outs = engine.run([EngineItem(rid, "decode", step, {"token": out.outputs["token"]}, {})
                               for rid, out in zip(ids, outs)])
            steps.append(time.perf_counter() - began)
        wall = time.perf_counter() - start
        if not all(out.finish_reason == "length" for out in outs):
            raise RuntimeError(f"the batch did not end at {new_tokens} tokens: {[o.finish_reason for o in outs]}")
    finally:
        for rid in ids:
            engine.release(rid)
    return {"prefill_s": prefill_s, "steps_s": steps, "wall_s": wall}


def run_ours_decode(settings: Settings) -> dict[str, Any]:
    """Each variant (experts kernel, or ``fused``) on one model: a warm-up batch per batch size,
    then ``decode_runs`` timed batches per size."""
    out: dict[str, Any] = {"variants": {}, "skipped": {}, "errors": {}}
    t0 = time.perf_counter()
    model = build_ours_thinker(settings)
    out["build_s"] = time.perf_counter() - t0
    out["parameters"] = sum(p.numel() for p in model.parameters())
    log.info("decode: ours built (%d layers, %.2f B parameters) in %.1f s", settings.layers, out["parameters"] / 1e9,
             out["build_s"])
    variants = (list(settings.decode_kernels) + (["fused"] if settings.fused else [])
                + (["fused+graphs"] if settings.cuda_graphs else []))
    generator = torch.Generator().manual_seed(settings.seed + 11)
    try:
        for variant in variants:
            try:
                if variant.startswith("fused"):
                    model.use_fused_kernels(True)
                else:
                    set_experts_kernel(model, variant)
            except (KernelUnavailable, NotImplementedError) as err:
                log.warning("decode: ours' %s variant skipped: %s", variant, err)
                out["skipped"][variant] = f"{type(err).__name__}: {err}"
                continue
            try:
                out["variants"][variant] = _ours_variant(settings, model, variant, generator)
            except Exception as err:  # keep the other variants' numbers
                log.exception("decode: ours' %s variant failed", variant)
                out["errors"][variant] = f"{type(err).__name__}: {err}"
    finally:
        del model
        free_device(settings.device)
    return out


def _ours_variant(settings: Settings, model, variant: str, generator: torch.Generator) -> dict[str, Any]:
    engine = ours_engine(settings, model, cuda_graphs=variant.endswith("+graphs"))
    result: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        for n in settings.batches:
            ours_batch(engine, random_prompts(settings, n, settings.prompt_len, generator), settings.warmup_tokens,
                       f"{variant}-warm{n}")
        result["warmup_s"] = time.perf_counter() - t0
        for n in settings.batches:
            runs = [ours_batch(engine, random_prompts(settings, n, settings.prompt_len, generator),
                               settings.new_tokens, f"{variant}-{n}-{r}") for r in range(settings.decode_runs)]
            steps = [s for r in runs for s in r["steps_s"]]
            wall = statistics.median(r["wall_s"] for r in runs)
            result[n] = {"step_ms_median": statistics.median(steps) * 1e3,
                         "step_ms_p90": sorted(steps)[int(0.9 * (len(steps) - 1))] * 1e3,
                         "prefill_ms_median": statistics.median(r["prefill_s"] for r in runs) * 1e3,
                         "wall_s": [r["wall_s"] for r in runs], "throughput_tok_s": n * settings.new_tokens / wall}
            log.info("decode: ours %s, batch %d: step %.2f ms (median), prefill %.0f ms, %.1f tok/s", variant, n,
                     result[n]["step_ms_median"], result[n]["prefill_ms_median"], result[n]["throughput_tok_s"])
    finally:
        del engine
        free_device(settings.device)
    return result


def thinker_config(settings: Settings) -> dict[str, Any]:
    """The thinker's ``config.json`` part (``thinker_config``) both sides are built from: the
    text decoder at the settings' shapes, the towers tiny."""
    hidden = settings.text["hidden_size"]
    return {"text_config": dict(settings.text), "audio_config": {**TINY_AUDIO, "output_dim": hidden},
            "vision_config": {**TINY_VISION, "out_hidden_size": hidden}, **MEDIA_IDS}


def build_baseline_thinker(settings: Settings):
    """transformers' thinker at the same config, built on the device in the run's dtype, its
    weights then drawn as ours are (normal 0.02; norms one)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    from mstar.model.weights import init_dummy_weights

    config = Qwen3OmniMoeThinkerConfig(**thinker_config(settings))
    with built_on(settings.device, settings.dtype):
        model = Qwen3OmniMoeThinkerForConditionalGeneration(config)
    init_dummy_weights(model, seed=settings.seed)
    synchronize(torch.device(settings.device))
    if settings.baseline_experts != getattr(model.config.text_config, "_experts_implementation", None):
        model.set_experts_implementation(settings.baseline_experts)
    return model.eval()


def run_baseline_decode(settings: Settings) -> dict[str, Any]:
    """transformers ``generate``: per batch size a warm-up, then ``baseline_runs`` calls of the
    whole length (median) and, at one stream, as many of one token (the prefill)."""
    device = torch.device(settings.device)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    model = build_baseline_thinker(settings)
    out["build_s"] = time.perf_counter() - t0
    out["experts_implementation"] = getattr(model.config.text_config, "_experts_implementation", None)
    out["attn_implementation"] = getattr(model.config.text_config, "_attn_implementation", None)
    out["text_parameters"] = sum(p.numel() for n, p in model.named_parameters()
                                 if "audio_tower" not in n and "visual" not in n)
    log.info("decode: transformers built (%.2f B text parameters, experts %s, attention %s) in %.1f s",
             out["text_parameters"] / 1e9, out["experts_implementation"], out["attn_implementation"], out["build_s"])
    generator = torch.Generator().manual_seed(settings.seed + 13)
    cache = {"cache_implementation": "static"} if settings.baseline_static else {}

    def generate(model, batch: int, tokens: int) -> float:  # `del` below frees the model
        ids = torch.stack(random_prompts(settings, batch, settings.prompt_len, generator)).to(device)
        synchronize(device)
        start = time.perf_counter()
        result = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **cache)
        synchronize(device)
        seconds = time.perf_counter() - start
        if result.shape[1] - settings.prompt_len != tokens:
            raise RuntimeError(f"transformers generated {result.shape[1] - settings.prompt_len} tokens, not {tokens}")
        return seconds

    try:
        with torch.inference_mode():
            out["warmup_s"] = {}
            for n in settings.batches:  # with the static cache, the first call per size compiles
                t0 = time.perf_counter()
                generate(model, n, settings.new_tokens if settings.baseline_static else settings.warmup_tokens)
                out["warmup_s"][n] = time.perf_counter() - t0
                log.info("decode: transformers warm-up at batch %d took %.1f s", n, out["warmup_s"][n])
            for n in settings.batches:
                wholes = [generate(model, n, settings.new_tokens) for _ in range(settings.baseline_runs)]
                firsts = [generate(model, n, 1) for _ in range(settings.baseline_runs)]
                whole, first = statistics.median(wholes), statistics.median(firsts)
                out[n] = {"wall_s": wholes, "prefill_ms": first * 1e3,  # a step: the quickest calls' difference
                          "step_ms": (min(wholes) - min(firsts)) / (settings.new_tokens - 1) * 1e3,
                          "total_ms_per_token": whole / settings.new_tokens * 1e3,
                          "throughput_tok_s": n * settings.new_tokens / whole}
                log.info("decode: transformers batch %d: step %.2f ms, prefill %.0f ms, %.1f tok/s", n,
                         out[n]["step_ms"], out[n]["prefill_ms"], out[n]["throughput_tok_s"])
    finally:
        del model
        free_device(settings.device)
    return out


def decode_metrics(settings: Settings, roof: ThinkerRoofline, ours: dict[str, Any] | None,
                   baseline: dict[str, Any] | None) -> list[Metric]:
    """Per ours variant: ``latency@1`` (ms/token) and ``throughput@N`` (tok/s) for N > 1."""
    rows: list[Metric] = []
    steps = settings.new_tokens - 1
    variants = list((ours or {}).get("variants", {})) or ([] if ours else ["(ours skipped)"])
    for variant in variants:
        result = (ours or {}).get("variants", {}).get(variant, {})
        for n in settings.batches:
            prefill, decode = roof.prefill_s(n, settings.prompt_len), roof.decode_s(n, settings.prompt_len, steps)
            notes: dict[str, Any] = {
                "layers": settings.layers, "floor_step_ms_mean": decode / steps * 1e3,
                "floor_prefill_ms": prefill * 1e3, "experts_hit_per_layer_step": roof.experts_hit(n),
                "floor_weight_gb_per_step": roof.weight_bytes(n) / 1e9,
                "ours_is": f"thinker text decoder on the autoregressive engine in process, experts {variant}",
                "baseline_is": "transformers Qwen3OmniMoeThinkerForConditionalGeneration.generate "
                               + ("(static cache, compiled)" if settings.baseline_static else "(dynamic cache, eager)"),
            }
            if n == 1:
                row = Metric(scenario_name(settings), f"latency@1 {variant}", "ms/token", "lower",
                             floor=decode / steps * 1e3, ours=result.get(1, {}).get("step_ms_median"),
                             baseline=(baseline or {}).get(1, {}).get("step_ms"))
            else:
                row = Metric(scenario_name(settings), f"throughput@{n} {variant}", "tok/s", "higher",
                             floor=n * settings.new_tokens / (prefill + decode),
                             ours=result.get(n, {}).get("throughput_tok_s"),
                             baseline=(baseline or {}).get(n, {}).get("throughput_tok_s"))
            row.notes.update(notes)
            row.notes.update({f"ours_{k}": v for k, v in result.get(n, {}).items()})
            row.notes.update({f"baseline_{k}": v for k, v in (baseline or {}).get(n, {}).items()})
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------ main
def scenario_name(settings: Settings) -> str:
    if settings.smoke:
        return f"{SCENARIO} (smoke: tiny shapes, CPU)"
    if settings.layers != THINKER_TEXT["num_hidden_layers"]:
        return f"{SCENARIO} ({settings.layers} of {THINKER_TEXT['num_hidden_layers']} layers)"
    return SCENARIO


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the code paths)")
    p.add_argument("--parts", default="moe,decode", help="which parts to run: moe, decode")
    p.add_argument("--layers", type=int, default=None, help="thinker decoder layers (default 48, the released)")
    p.add_argument("--moe-tokens", default=None, help="MoE token counts (default 1,8,32,128,512,2048,8192)")
    p.add_argument("--moe-kernels", default=",".join(KERNELS), help="ours' experts kernels in the MoE part")
    p.add_argument("--moe-runs", type=int, default=None, help="timed MoE forwards per column, median (default 20)")
    p.add_argument("--baseline-experts", default="grouped_mm",
                   help="transformers' experts implementation of the baseline columns (eager, grouped_mm, ...)")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,8)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per stream (default 128)")
    p.add_argument("--decode-runs", type=int, default=None, help="timed batches per size for ours (default 2)")
    p.add_argument("--baseline-runs", type=int, default=None, help="timed generate calls per size (default 2)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens per stream of the warm-up batches")
    p.add_argument("--decode-kernels", default="loop,grouped_mm", help="ours' experts kernels in decode")
    p.add_argument("--fused", action="store_true", help="also decode with the thinker's use_fused_kernels(True)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also decode fused with the engine's cuda_graphs (variant fused+graphs; Triton attention)")
    p.add_argument("--attention-backend", choices=("torch", "triton"), default="torch",
                   help="ours' paged attention (the thinker's attention_backend knob)")
    p.add_argument("--baseline-static", action="store_true",
                   help="transformers generate with the static cache (compiled; long warm-up)")
    p.add_argument("--skip-ours", action="store_true", help="decode: do not run M*")
    p.add_argument("--skip-baseline", action="store_true", help="decode: do not run transformers")
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    settings = settings_from(args)
    started = time.perf_counter()
    log.info("S9 settings: %s", settings.describe())
    bandwidth = measure_memory_bandwidth(settings.device)
    tflops = measure_matmul_tflops(settings.device, settings.dtype)
    size = torch.finfo(settings.dtype).bits // 8
    roof = ThinkerRoofline(settings.text, size, bandwidth, tflops)
    log.info("measured %.0f GB/s copy bandwidth, %.1f TFLOP/s %s matmul", bandwidth, tflops, settings.dtype)

    errors: dict[str, str] = {}
    metrics: list[Metric] = []
    moe = ours = baseline = None
    if "moe" in settings.parts:
        try:
            moe = run_moe(settings, bandwidth, tflops)
            errors.update({f"moe {k}": v for k, v in moe["errors"].items()})
            metrics += moe_metrics(settings, moe)
        except Exception as err:
            log.exception("the MoE part failed")
            errors["moe"] = f"{type(err).__name__}: {err}"
    if "decode" in settings.parts:
        if not settings.skip_ours:
            try:
                ours = run_ours_decode(settings)
                errors.update({f"decode ours {k}": v for k, v in ours["errors"].items()})
            except Exception as err:
                log.exception("ours' decode failed")
                errors["decode ours"] = f"{type(err).__name__}: {err}"
        if not settings.skip_baseline:
            try:
                baseline = run_baseline_decode(settings)
            except Exception as err:  # keep ours' numbers when the baseline cannot run
                log.exception("transformers' decode failed")
                errors["decode baseline"] = f"{type(err).__name__}: {err}"
        metrics += decode_metrics(settings, roof, ours, baseline)

    record = {
        "scenario": scenario_name(settings),
        "hardware": hardware(),
        "settings": settings.describe(),
        "roofline": {"memory_bandwidth_gbs": bandwidth, "matmul_tflops": tflops,
                     "kv_bytes_per_position": roof.kv_bytes_per_position,
                     "decode_flops_per_token": roof.flops_per_token()},
        "metrics": metrics,
        "moe": _jsonable(moe),
        "decode": {"ours": _jsonable(ours), "baseline": _jsonable(baseline)},
        "errors": errors,
        "total_s": time.perf_counter() - started,
    }
    write_record(NAME, record, args.out)
    log.info("S9 done in %.1f s%s", record["total_s"], f"; errors: {sorted(errors)}" if errors else "")
    return 1 if errors else 0


def _jsonable(value: Any) -> Any:
    """Integer keys (token counts, batch sizes) as strings, for JSON."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    sys.exit(main())
