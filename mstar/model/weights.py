"""Model-agnostic weight loading: locating checkpoints, reading safetensors, filling modules.

Model modules name their parameters exactly like the Hugging Face checkpoint keys, so loading is
a by-name copy. ``load_weights`` checks coverage both ways (every parameter filled, every
checkpoint tensor used) and leaves room for per-parameter ``weight_loader`` hooks, which
tensor-parallel layers use to take their shard of a full tensor. A fused layer (one with
``segment_names`` and ``load_segment``, e.g. ``[q | k | v]`` in one matrix) also loads from
the unfused checkpoint names, one segment each.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import constants as hf_constants
from safetensors import safe_open
from torch import nn

__all__ = [
    "ModelPathError",
    "WeightLoadError",
    "building",
    "fill_weights",
    "init_dummy_weights",
    "iter_safetensors",
    "load_weights",
    "resolve_model_path",
]

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

NameMap = Callable[[str], str | None]
"""Maps a checkpoint tensor name to a module name; ``None`` drops the tensor on purpose."""

_MAX_LISTED = 8


class WeightLoadError(RuntimeError):
    """A checkpoint does not fit the module it is loaded into."""


class ModelPathError(FileNotFoundError):
    """A model path is neither a local directory/file nor a reachable Hugging Face hub repo."""


def _offline() -> bool:
    """Offline mode, read at call time (huggingface_hub reads ``HF_HUB_OFFLINE`` at import)."""
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return hf_constants.HF_HUB_OFFLINE or env in {"1", "ON", "YES", "TRUE"}


def resolve_model_path(
    model_path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    allow_patterns: str | Sequence[str] | None = None,
) -> Path:
    """Return a local path for ``model_path``.

    An existing local directory (or file, e.g. a ``.gguf``) is returned as is. Anything else is
    taken as a hub repo id and resolved with ``huggingface_hub.snapshot_download``, which serves
    from the hub cache under ``cache_dir`` without network access when ``HF_HUB_OFFLINE=1``.
    """
    local = Path(model_path).expanduser()
    if local.exists():
        return local
    repo_id = os.fspath(model_path)
    patterns = [allow_patterns] if isinstance(allow_patterns, str) else allow_patterns
    where = f"hub cache {os.fspath(cache_dir) if cache_dir else hf_constants.HF_HUB_CACHE}"
    wanted = f" (files matching {list(patterns)})" if patterns else ""
    if repo_id.startswith(("/", ".", "~")) or repo_id.count("/") > 1:
        raise ModelPathError(
            f"model path {repo_id!r} does not exist, and is not a hub repo id "
            "of the form 'org/name'"
        )
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            cache_dir=cache_dir,
            allow_patterns=list(patterns) if patterns else None,
            local_files_only=_offline(),
        )
    except Exception as exc:  # hub errors are many and version dependent; re-raise uniformly
        mode = "offline, cache only" if _offline() else "online"
        raise ModelPathError(
            f"model {repo_id!r} is not a local path and could not be resolved as a "
            f"Hugging Face hub repo{wanted} ({mode}, {where}): {type(exc).__name__}: {exc}"
        ) from exc
    return Path(snapshot)


def _safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, index first, then single file, then any."""
    index = directory / SAFETENSORS_INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
        return files
    single = directory / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no safetensors checkpoint in {directory}: looked for {SAFETENSORS_INDEX_FILE}, "
            f"{SAFETENSORS_FILE} and *.safetensors"
        )
    return files


def iter_safetensors(directory: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each tensor of the checkpoint in ``directory``, lazily."""
    for file in _safetensors_files(Path(directory)):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _loadable(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every name (tied aliases included) of the parameters and persistent buffers of ``module``."""
    targets: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                targets[f"{prefix}.{name}" if prefix else name] = buf
    return targets


def _segments(module: nn.Module) -> dict[str, tuple[nn.Module, nn.Parameter, int]]:
    """``{checkpoint name: (layer, parameter, segment index)}`` for the fused layers of
    ``module``: segment ``i`` of ``<parent>.<fused>.weight`` loads from
    ``<parent>.<segment_names[i]>.weight`` (likewise ``bias``)."""
    found: dict[str, tuple[nn.Module, nn.Parameter, int]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        names = getattr(sub, "segment_names", None)
        if not names:
            continue
        parent = prefix.rpartition(".")[0]
        for param_name, param in sub.named_parameters(recurse=False):
            for index, segment in enumerate(names):
                found[".".join(p for p in (parent, segment, param_name) if p)] = (sub, param, index)
    return found


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    more = f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return f"{len(names)}: {shown}{more}"


@torch.no_grad()
def load_weights(
    module: nn.Module,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    name_map: NameMap | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
) -> None:
    """Copy checkpoint tensors into ``module``'s parameters and persistent buffers by name.

    ``name_map`` renames checkpoint names (returning ``None`` skips a tensor). Tensors are cast
    to ``dtype`` if given, else to the target's dtype. A parameter with a ``weight_loader``
    attribute gets ``param.weight_loader(param, tensor)`` instead of a copy (shape checks are then
    the hook's job). With ``strict``, a ``WeightLoadError`` lists the parameters the checkpoint
    left unfilled and the checkpoint tensors that fill nothing. Tied parameters count as filled
    when any of their names is; a fused parameter when its own name is, or every one of its
    segments' names (``_segments``).
    """
    targets = _loadable(module)
    segments = _segments(module)
    filled: set[int] = set()
    segments_filled: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in named_tensors:
        name = name_map(ckpt_name) if name_map is not None else ckpt_name
        if name is None:
            continue
        target = targets.get(name)
        if target is None and name in segments:
            layer, param, index = segments[name]
            try:
                layer.load_segment(param, index, tensor if dtype is None else tensor.to(dtype))
            except ValueError as err:
                raise WeightLoadError(f"cannot load segment {index} of a fused parameter from checkpoint "
                                      f"tensor {ckpt_name!r}: {err}") from None
            segments_filled.add(name)
            continue
        if target is None:
            unexpected.append(ckpt_name if name == ckpt_name else f"{ckpt_name} (as {name})")
            continue
        loader = getattr(target, "weight_loader", None)
        if loader is not None:  # a sharded parameter takes its part of the full tensor
            try:
                loader(target, tensor if dtype is None else tensor.to(dtype))
            except ValueError as err:
                raise WeightLoadError(f"cannot load {name!r} from checkpoint tensor {ckpt_name!r}: {err}") from None
        else:
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightLoadError(
                    f"shape mismatch for {name!r}: checkpoint tensor {ckpt_name!r} has shape "
                    f"{tuple(tensor.shape)}, the module expects {tuple(target.shape)}"
                )
            target.copy_(tensor.to(dtype or target.dtype))
        filled.add(id(target))
    if not strict:
        return
    by_param: dict[int, list[str]] = {}
    for seg_name, (_, param, _) in segments.items():
        by_param.setdefault(id(param), []).append(seg_name)
    partial: dict[int, list[str]] = {}  # a fused parameter filled in part: the segments it lacks
    for key, seg_names in by_param.items():
        lacking = [n for n in seg_names if n not in segments_filled]
        if not lacking:
            filled.add(key)
        elif len(lacking) < len(seg_names):
            partial[key] = lacking
    missing: list[str] = []
    for name, t in targets.items():
        if id(t) not in filled:
            missing.extend(partial.pop(id(t), [name]))
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"parameters the checkpoint did not fill ({_listing(missing)})")
        if unexpected:
            problems.append(f"checkpoint tensors nothing loads ({_listing(unexpected)})")
        raise WeightLoadError(
            f"checkpoint does not match {type(module).__name__}: " + "; ".join(problems)
        )


@contextmanager
def building(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """Modules constructed inside are made on ``device`` in ``dtype`` at once: torch's default
    device and floating dtype are set for the block and restored after it, however it ends.

    ``with torch.device(device): Model(config).to(torch.bfloat16)`` first holds the whole model
    in float32 (twice the bf16 bytes: 36 GB for a 9B LLM), then a second copy while it casts;
    ``with building(device, torch.bfloat16): Model(config)`` never holds more than the bf16
    model. A tensor a module's constructor makes with an explicit dtype keeps it (an fp32
    window, an int64 index); one it computes in the default dtype (``torch.linspace``,
    ``torch.arange`` over floats) is computed in ``dtype``, so such constructors name float32
    where precision matters. With ``dtype`` float32 a build is exactly the plain one.

    The default dtype is process-wide (torch keeps one, not one per thread): build while no
    other thread makes tensors, as a worker does before it serves.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"building: {dtype} is not a floating-point dtype")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


_DRAWN_IN_PLACE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""The dtypes ``normal_`` fills directly; a parameter of another dtype is drawn in float32 and cast."""


@torch.no_grad()
def init_dummy_weights(module: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights at the real shapes, for ``load_format: dummy`` (no checkpoint).

    Matrices and embeddings get ``N(0, std)``, 1-D norm weights get ones and other 1-D tensors
    (biases) zeros. The result depends only on ``seed``, the parameter names, shapes and dtypes,
    and the device kind (values are drawn where the parameters live: billions of them on one
    CPU thread would take minutes). Parameters on the meta device hold no values and are left
    as they are (a model built there checks its shapes without allocating them).

    Values are drawn into each parameter, in its own dtype, with no temporary: torch's normal
    sampler computes in float32 and rounds once to a 16-bit dtype, so a bf16 draw is a float32
    draw cast to bf16, without the float32 copy and the cast copy the fill used to make of each
    tensor (measured on a 400 MB bf16 Llama on the CPU, torch 2.13, one thread: the fill's peak
    memory over the model went from +216 to +256 MB, those two copies of the 32.8M-element
    embedding, to none, and its CPU time from 1.1-1.3 s to 0.9 s). On the CPU the values are
    those of the float32 draw then cast, except that a tensor whose size is not a multiple of
    16 has its last 16 redrawn from a different point of the stream, which shifts the draws of
    every tensor after it: the same distribution, and the same values for the same seed. On
    the GPU torch's sampler draws in float32 too (curand) and rounds once; not run here.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in module.named_parameters():
        if param.is_meta:
            continue
        if param.dim() >= 2:
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            _draw_normal(param, std, generators[param.device])
        elif "norm" in name and name.endswith("weight"):
            param.fill_(1.0)
        else:
            param.zero_()


def _draw_normal(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """``param`` filled with ``N(0, std)`` in place; a temporary only where the sampler cannot
    fill it directly (a strided view: drawn contiguous in its dtype; another dtype: float32)."""
    if param.dtype in _DRAWN_IN_PLACE and param.is_contiguous():
        param.normal_(0.0, std, generator=generator)
        return
    dtype = param.dtype if param.dtype in _DRAWN_IN_PLACE else torch.float32
    values = torch.empty(param.shape, dtype=dtype, device=param.device).normal_(0.0, std, generator=generator)
    param.copy_(values)


def fill_weights(module: nn.Module, tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]], *, dummy: bool,
                 seed: int, dtype: torch.dtype | None = None, **load) -> nn.Module:
    """``module`` filled with seeded random weights (``dummy``: ``load_format: dummy``, the
    checkpoint is never read) or with the checkpoint's ``tensors()`` (``load_weights``, coverage
    checked both ways; ``load`` are its options); returned in eval mode."""
    if dummy:
        init_dummy_weights(module, seed=seed)
    else:
        load_weights(module, tensors(), dtype=dtype, **load)
    return module.eval()
