"""Typed ``model_kwargs``: a family's deployment knobs, and the options of a request.

A family declares its deployment knobs as a subclass of ``Knobs`` (``ModelSpec.Knobs``). The
spec parses ``config.model_kwargs`` once, when it is made (before anything loads), so a
misspelt key or a bad value stops startup with one line naming ``model_kwargs.<key>`` and the
rule; for an unknown key, the line lists the keys the family takes.

A family takes only the switches it implements. The switches are small pieces here
(``CudaGraphs``, ``FusedKernels``, ``OverlapScheduling``, ``Compile``, ``PrefixCaching``,
``Quantization``), mixed into the classes of the families that run them (``DecodeKnobs`` for
the decode engines of the Llama family, the diffusion families' ``DiffusionKnobs``), so a
switch a family would ignore is refused rather than silently accepted. Rules between keys, and
rules that need the deployment's device (a switch that runs on CUDA only), are checked by
``check`` once the types are.

``RequestKnobs`` does the same for the ``model_kwargs`` of one request (``GenerateSpec``,
``SpeechSpec``, ``ImageSpec``): a problem is a ``RequestError`` naming the field (HTTP 400).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mstar.config import ConfigError
from mstar.contract import RequestError

# Types are strict: YAML and JSON give booleans, integers and lists as they are, and a
# string "yes" where a boolean belongs is a mistake to name, not a value to coerce.
_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)

_RULES = {
    "bool_type": "must be true or false",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "finite_number": "must be a finite number",
}
_UNKNOWN = "unknown key"
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _key(loc: tuple) -> str:
    """A pydantic location as a key path: ``("lora", 0, "scale")`` -> ``lora[0].scale``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _rule(error: dict) -> str:
    """What a pydantic error asks for, in the words of our other config errors."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"must be {_BOUNDS[kind]} {bound}, got {error['input']!r}"
    if kind == "literal_error":
        return f"must be {ctx['expected']}, got {error['input']!r}"
    if kind in _RULES:
        return f"{_RULES[kind]}, got {error['input']!r}"
    if kind == "value_error":
        return str(ctx["error"])
    return error["msg"].replace("Input should be", "must be")


def _problems(cls: type[BaseModel], err: ValidationError, prefix: str) -> list[tuple[str, str]]:
    """``(key, rule)`` per problem, the key under ``prefix``; an unknown key's rule lists the
    keys ``cls`` takes."""
    problems = []
    for error in err.errors():
        if error["type"] == "default_factory_not_called":  # a default that read a bad value
            continue
        key = prefix + _key(error["loc"])
        if error["type"] == "extra_forbidden":
            problems.append((key, f"{_UNKNOWN}; valid keys: {', '.join(sorted(cls.model_fields))}"))
            continue
        rule = _rule(error)
        if prefix and rule.startswith(prefix):  # a validator named a deeper key: model_kwargs.lora[0]: ...
            key, rule = rule.split(": ", 1)
        problems.append((key, rule))
    return problems


class Knobs(BaseModel):
    """The deployment knobs every family takes; the base of every family's knobs class."""

    model_config = _STRICT

    seed: int = Field(0, ge=0)
    """The seed of ``load_format: dummy`` weights (random weights of the real shapes)."""

    @classmethod
    def parse(cls, data: Mapping[str, Any], *, device: str = "cpu") -> Self:
        """The knobs of ``data`` (a deployment's ``model_kwargs``) on ``device`` ("cpu" or
        "cuda"); raises ``ConfigError`` naming every key that is unknown or bad."""
        try:
            knobs = cls.model_validate(dict(data))
        except ValidationError as err:
            problems = _problems(cls, err, "model_kwargs.")
            raise ConfigError("; ".join(f"{key}: {rule}" for key, rule in problems)) from None
        knobs.check(device)
        return knobs

    def check(self, device: str) -> None:
        """Rules between keys, and what ``device`` cannot run: ``ConfigError`` naming the key.
        A class that adds a rule calls ``super().check(device)`` first."""


def triton_interpreted() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET=1``): Triton kernels then run
    on the CPU too (slowly; tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_cuda(key: str, device: str) -> None:
    """Refuse ``model_kwargs.<key>`` on a deployment that is not on CUDA."""
    if device != "cuda":
        raise ConfigError(f"model_kwargs.{key} needs device: cuda")


# ------------------------------------------------------------------ shared switches
class CudaGraphs(Knobs):
    cuda_graphs: bool = False
    """Replay steps from CUDA graphs captured per batch bucket (CUDA only; eager is the reference)."""

    def check(self, device: str) -> None:
        super().check(device)
        if self.cuda_graphs:
            require_cuda("cuda_graphs", device)


class FusedKernels(Knobs):
    fused_kernels: bool = False
    """Run element-wise work (norms, activations, RoPE) as fused Triton kernels (CUDA only)."""

    # Whether the family's kernels also run under Triton's CPU interpreter (TRITON_INTERPRET=1:
    # slowly, for tests), so that fused_kernels is taken on the CPU then.
    interpreted_on_cpu: ClassVar[bool] = False

    def check(self, device: str) -> None:
        super().check(device)
        if self.fused_kernels and not (self.interpreted_on_cpu and triton_interpreted()):
            require_cuda("fused_kernels", device)


class OverlapScheduling(Knobs):
    overlap_scheduling: bool = False
    """Launch decode step k+1 before the host has finished step k's bookkeeping."""


class Compile(Knobs):
    compile: bool = False
    """``torch.compile`` the main network (traced per shape on first use; eager is the reference)."""

    compile_backend: str = "inductor"
    """The ``torch.compile`` backend (``aot_eager`` for tests on the CPU)."""

    @property
    def compiles(self) -> bool:
        """Whether anything is compiled (a family with more compile switches widens it)."""
        return self.compile

    def check(self, device: str) -> None:
        super().check(device)
        if self.compiles:
            import torch

            if self.compile_backend not in torch.compiler.list_backends(exclude_tags=()):
                raise ConfigError("model_kwargs.compile_backend: must name a registered torch.compile backend "
                                  f"(inductor, aot_eager, cudagraphs, ...), got {self.compile_backend!r}")


class PrefixCaching(Knobs):
    prefix_caching: bool = True
    """Keep the KV pages of computed prompts (whole pages, content-addressed) and start a
    request whose prompt begins the same way (a system prompt, a chat history) on them, so its
    prefill computes only the rest; idle cached pages are evicted, least recently used first,
    when the pool needs them. Outputs are the same with it off. Offered by the families whose
    K/V depend on the token ids alone: not Qwen3.5 (its DeltaNet layers' recurrent state is not
    cached with the pages, and image placeholders' K/V depend on the image) nor Whisper (its
    decoder's K/V depend on the audio)."""


class PrefillBudget(Knobs):
    max_prefill_tokens: int | None = Field(default=2048, ge=1)
    """The most prompt tokens a step computes for the prefills it takes on (the part of a
    prompt not found in the prefix cache; a preempted sequence's history it recomputes):
    the prefills past it wait for the next step, in arrival order, while the running
    sequences keep decoding. A burst of prompts then gets its first tokens step by step
    rather than all after one long step, and running streams stall for less. The oldest
    waiting prompt always runs, whatever its length (a prompt is not split over steps).
    None: every prefill of a step runs at once."""


class DecodeKnobs(CudaGraphs, FusedKernels, OverlapScheduling, PrefixCaching, PrefillBudget):
    """The knobs of a Llama-family decode engine (the Llama LLMs, the Orpheus talker); eager
    torch is the default and the reference. ``cuda_graphs`` runs the Triton attention kernels
    whatever ``attention_backend`` says (the torch reference synchronises with the host and
    cannot be captured)."""

    attention_backend: Literal["torch", "triton"] = "torch"
    """The paged-attention kernels: ``torch`` (the reference) or ``triton``."""



class Quantization(Knobs):
    quantization: Literal["none", "int8", "int4", "gguf", "w8a8"] | None = None
    """Quantised linear layers on the CPU (``mstar.model.quantize``): ``none`` (float weights;
    a GGUF file dequantised), weight-only ``int8`` (per-row scales), ``int4`` (groups of 32),
    ``gguf`` (a GGUF file's Q4_0/Q4_1/Q8_0 blocks kept as stored), all three with bfloat16
    products; ``w8a8``: int8 weights (per-row scales) times activations rounded to int8 per
    token, int32 sums. Unset: ``gguf`` for a GGUF checkpoint on the CPU, else ``none``."""

    def check(self, device: str) -> None:
        super().check(device)
        if self.quantization not in (None, "none") and device != "cpu":
            raise ConfigError(f"model_kwargs.quantization: {self.quantization} runs on the CPU only "
                              "(PyTorch's int4/int8 CPU kernels); use none on CUDA")


# ------------------------------------------------------------------ request options
class RequestKnobs(BaseModel):
    """The ``model_kwargs`` of one request, typed; the base of every family's request options."""

    model_config = _STRICT

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> Self:
        """The options of ``data``; raises ``RequestError`` for the first problem, named by its
        key (an unknown key: by ``model_kwargs``)."""
        try:
            options = cls.model_validate(dict(data))
        except ValidationError as err:
            key, rule = _problems(cls, err, "")[0]
            if rule.startswith(_UNKNOWN):
                key, rule = "model_kwargs", f"{_UNKNOWN} {key!r}" + rule.removeprefix(_UNKNOWN)
            raise RequestError(key, rule) from None
        options.check()
        return options

    def check(self) -> None:
        """Rules between keys: ``RequestError`` naming the field."""
