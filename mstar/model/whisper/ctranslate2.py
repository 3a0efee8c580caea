"""CTranslate2 ``model.bin`` reading/writing, and its Whisper layout mapped to Hugging Face names.

Binary format (``binary_version`` 6, as written by CTranslate2's ``ModelSpec._serialize``; all
integers little-endian, no alignment padding)::

    u32 binary_version                      # 6
    str spec_name                           # e.g. "WhisperSpec"
    u32 spec_revision                       # WhisperSpec: 3
    u32 num_variables
    num_variables x:
        str name                            # "/"-separated scopes, e.g. "encoder/layer_0/..."
        u8  rank;  u32 dims[rank]           # rank 0 = scalar (e.g. num_heads)
        u8  dtype_id                        # 0 f32, 1 i8, 2 i16, 3 i32, 4 f16, 5 bf16
        u32 num_bytes;  u8 data[num_bytes]  # C order
    u32 num_aliases
    num_aliases x: str alias; str target    # alias names a variable stored once (deduplicated)

where ``str`` is ``u16 length`` (including a trailing NUL) followed by that many bytes. Strings
and booleans in a spec are stored as int8 arrays/scalars. Variables are sorted by name.

Whisper layout (``WhisperSpec``, CTranslate2's converter from ``WhisperForConditionalGeneration``)
versus Hugging Face names (``E = model.encoder``, ``D = model.decoder``, ``L = layers.{i}``)::

    encoder/num_heads (int16 scalar)                  -> config only (encoder_attention_heads)
    encoder/conv{1,2}/{weight,bias}                   -> E.conv{1,2}.{weight,bias}
    encoder/position_encodings/encodings              -> E.embed_positions.weight
    encoder/layer_norm/{gamma,beta}                   -> E.layer_norm.{weight,bias}
    encoder/layer_{i}/self_attention/linear_0/*       -> E.L.self_attn.{q,k,v}_proj.*  (fused q|k|v)
    encoder/layer_{i}/self_attention/linear_1/*       -> E.L.self_attn.out_proj.*
    encoder/layer_{i}/self_attention/layer_norm/*     -> E.L.self_attn_layer_norm.*
    encoder/layer_{i}/ffn/linear_{0,1}/*              -> E.L.fc{1,2}.*
    encoder/layer_{i}/ffn/layer_norm/*                -> E.L.final_layer_norm.*
    decoder/{num_heads, activation, pre_norm, scale_embeddings, alibi, start_from_zero_embedding,
             alignment_layer, alignment_heads}   -> config only (scalars; the architectural
                                                    ones are checked: GELU, pre-norm, no scaling)
    decoder/embeddings/weight                         -> D.embed_tokens.weight
    decoder/projection/weight                         -> tied to D.embed_tokens (usually an alias)
    decoder/position_encodings/encodings              -> D.embed_positions.weight
    decoder/layer_norm/*                              -> D.layer_norm.*
    decoder/layer_{i}/self_attention/linear_0/*       -> D.L.self_attn.{q,k,v}_proj.*  (fused q|k|v)
    decoder/layer_{i}/self_attention/linear_1/*       -> D.L.self_attn.out_proj.*
    decoder/layer_{i}/self_attention/layer_norm/*     -> D.L.self_attn_layer_norm.*
    decoder/layer_{i}/attention/linear_0/*            -> D.L.encoder_attn.q_proj.*
    decoder/layer_{i}/attention/linear_1/*            -> D.L.encoder_attn.{k,v}_proj.*  (fused k|v)
    decoder/layer_{i}/attention/linear_2/*            -> D.L.encoder_attn.out_proj.*
    decoder/layer_{i}/attention/layer_norm/*          -> D.L.encoder_attn_layer_norm.*
    decoder/layer_{i}/ffn/linear_{0,1}/*              -> D.L.fc{1,2}.*
    decoder/layer_{i}/ffn/layer_norm/*                -> D.L.final_layer_norm.*

The real whisper_base file is float16 (212 variables + 1 alias). Fused weights are
concatenated along the output dimension (rows). Their bias is fused the same
way, with zeros in the k slot (HF's ``k_proj`` has no bias); that slot is dropped: a key bias adds
the same ``q . b`` to every score of a query, which softmax ignores. Quantised weights (int8 /
int16 with a ``<name>_scale`` variable) are dequantised; everything is returned as float32.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

__all__ = [
    "CT2Model",
    "read_ct2_model",
    "whisper_config_from_ct2",
    "whisper_hf_names",
    "whisper_hf_tensors",
    "write_ct2_model",
]

BINARY_VERSION = 6
# dtype id -> (name, little-endian numpy storage); bfloat16 is kept as its raw uint16 bits.
_DTYPES: tuple[tuple[str, np.dtype], ...] = (
    ("float32", np.dtype("<f4")),
    ("int8", np.dtype("i1")),
    ("int16", np.dtype("<i2")),
    ("int32", np.dtype("<i4")),
    ("float16", np.dtype("<f2")),
    ("bfloat16", np.dtype("<u2")),
)
_DTYPE_IDS = {name: i for i, (name, _) in enumerate(_DTYPES)}

PathLike = str | os.PathLike[str]


@dataclass
class CT2Model:
    """The content of a CTranslate2 ``model.bin``.

    ``variables`` holds numpy arrays in their stored dtype, except bfloat16 which numpy lacks:
    those are uint16 bit patterns, flagged in ``dtypes`` (name -> CT2 dtype name; a variable
    missing there is typed by its numpy dtype). ``aliases`` maps alias -> stored variable.
    """

    spec_name: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    binary_version: int = BINARY_VERSION

    def resolve(self, name: str) -> str:
        """The stored variable name behind ``name`` (following aliases)."""
        seen: set[str] = set()
        while name not in self.variables and name in self.aliases and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        if name not in self.variables:
            raise KeyError(f"CTranslate2 variable {name!r} not found")
        return name

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.variables or name in self.aliases)

    def names(self) -> list[str]:
        """All variable and alias names, sorted."""
        return sorted({*self.variables, *self.aliases})

    def dtype(self, name: str) -> str:
        """CT2 dtype name of variable ``name`` (alias allowed)."""
        name = self.resolve(name)
        return self.dtypes.get(name) or _dtype_name(self.variables[name].dtype)

    def tensor(self, name: str) -> torch.Tensor:
        """Variable ``name`` (alias allowed) as a new float32 tensor (bfloat16 decoded)."""
        array = self.variables[self.resolve(name)]
        if self.dtype(name) == "bfloat16":
            return torch.from_numpy((array.astype(np.uint32) << 16).view(np.float32))
        return torch.from_numpy(np.array(array, dtype=np.float32))

    def scalar(self, name: str) -> int | float:
        """A rank-0 (or single-element) variable as a Python number."""
        value = self.variables[self.resolve(name)]
        if value.size != 1:
            raise ValueError(f"CTranslate2 variable {name!r} is not a scalar: {value.shape}")
        return value.reshape(()).item()


def _dtype_name(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    for name, stored in _DTYPES[:-1]:  # uint16 is only bfloat16 when tagged so
        if (dtype.kind, dtype.itemsize) == (stored.kind, stored.itemsize):
            return name
    raise ValueError(f"numpy dtype {dtype} has no CTranslate2 equivalent")


class _ChainedReader:
    """Sequential reads over the concatenation of several files, without joining them."""

    def __init__(self, paths: list[Path]) -> None:
        self._pending = list(reversed(paths))
        self._file: BinaryIO | None = None
        self._advance()

    def _advance(self) -> bool:
        """Close the current file and open the next; False when none is left."""
        if self._file is not None:
            self._file.close()
        self._file = open(self._pending.pop(), "rb") if self._pending else None  # noqa: SIM115
        return self._file is not None

    def close(self) -> None:
        self._pending.clear()
        self._advance()

    def readinto(self, buffer: memoryview) -> None:
        """Fill ``buffer`` entirely, crossing file boundaries; EOFError if the data ends."""
        filled = 0
        while filled < len(buffer):
            n = self._file.readinto(buffer[filled:]) if self._file is not None else 0
            if n:
                filled += n
            elif not self._advance():
                raise EOFError("truncated CTranslate2 model file")

    def read(self, size: int) -> bytes:
        buffer = bytearray(size)
        self.readinto(memoryview(buffer))
        return bytes(buffer)

    def at_end(self) -> bool:
        while self._file is not None:
            if self._file.read(1):
                return False
            self._advance()
        return True

    def u8(self) -> int:
        return self.read(1)[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def string(self) -> str:
        raw = self.read(struct.unpack("<H", self.read(2))[0])
        if not raw or raw[-1] != 0:
            raise ValueError("malformed string in CTranslate2 model file (no trailing NUL)")
        return raw[:-1].decode("utf-8")


def read_ct2_model(paths: list[Path] | list[PathLike] | PathLike) -> CT2Model:
    """Read a CTranslate2 ``model.bin``, possibly split into parts to be concatenated in order."""
    parts = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not parts:
        raise ValueError("no model file given")
    for part in parts:
        if not part.is_file():
            raise FileNotFoundError(f"CTranslate2 model file {part} does not exist")
    reader = _ChainedReader(parts)
    try:
        version = reader.u32()
        if version != BINARY_VERSION:
            raise ValueError(f"unsupported CTranslate2 binary version {version} (need 6)")
        spec_name = reader.string()
        revision = reader.u32()
        variables: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        for _ in range(reader.u32()):
            name = reader.string()
            shape = tuple(reader.u32() for _ in range(reader.u8()))
            dtype_id = reader.u8()
            if dtype_id >= len(_DTYPES):
                raise ValueError(f"variable {name!r}: unknown CTranslate2 dtype id {dtype_id}")
            dtype_name, dtype = _DTYPES[dtype_id]
            num_bytes = reader.u32()
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if num_bytes != expected:
                raise ValueError(
                    f"variable {name!r}: {num_bytes} bytes stored, {expected} expected for "
                    f"{dtype_name}{list(shape)}"
                )
            array = np.empty(shape, dtype=dtype)
            reader.readinto(memoryview(array.reshape(-1).view(np.uint8)))
            variables[name] = array
            dtypes[name] = dtype_name
        aliases = {}
        for _ in range(reader.u32()):
            alias = reader.string()
            aliases[alias] = reader.string()
        if not reader.at_end():
            raise ValueError("trailing data after the CTranslate2 model's alias table")
    finally:
        reader.close()
    return CT2Model(spec_name, revision, variables, aliases, dtypes, version)


def write_ct2_model(
    path: PathLike,
    spec_name: str,
    variables: Mapping[str, np.ndarray],
    aliases: Mapping[str, str] | None = None,
    revision: int = 1,
    dtypes: Mapping[str, str] | None = None,
) -> None:
    """Write a CTranslate2 ``model.bin`` (binary version 6), variables sorted by name.

    ``dtypes`` may name a variable's CT2 dtype where the numpy dtype is ambiguous: a uint16
    array tagged ``"bfloat16"`` is written as raw bfloat16 bits.
    """
    dtypes = dict(dtypes or {})

    def string(text: str) -> bytes:
        raw = text.encode("utf-8") + b"\0"
        return struct.pack("<H", len(raw)) + raw

    with open(path, "wb") as out:
        out.write(struct.pack("<I", BINARY_VERSION) + string(spec_name))
        out.write(struct.pack("<II", revision, len(variables)))
        for name in sorted(variables):
            array = np.asarray(variables[name])
            dtype_name = dtypes.get(name) or _dtype_name(array.dtype)
            stored = _DTYPES[_DTYPE_IDS[dtype_name]][1]
            if dtype_name == "bfloat16" and array.dtype != np.uint16:
                raise ValueError(f"bfloat16 variable {name!r} must be given as uint16 bits")
            data = np.ascontiguousarray(array, dtype=stored).tobytes()
            out.write(string(name) + struct.pack("<B", array.ndim))
            out.write(struct.pack(f"<{array.ndim}I", *array.shape))
            out.write(struct.pack("<BI", _DTYPE_IDS[dtype_name], len(data)) + data)
        alias_items = sorted((aliases or {}).items())
        out.write(struct.pack("<I", len(alias_items)))
        for alias, target in alias_items:
            out.write(string(alias) + string(target))


# ---------------------------------------------------------------------------------------------
# Whisper: CTranslate2 names -> Hugging Face names
# ---------------------------------------------------------------------------------------------

# Scalars that only describe the architecture, with the value our model requires (None: any).
_WHISPER_SCALARS: dict[str, int | None] = {
    "encoder/num_heads": None,
    "decoder/num_heads": None,
    "decoder/activation": 3,  # CTranslate2 Activation.GELU (exact erf GELU)
    "decoder/pre_norm": 1,
    "decoder/scale_embeddings": 0,
    "decoder/alibi": 0,
    "decoder/start_from_zero_embedding": 0,
    "decoder/alignment_layer": None,
    "decoder/alignment_heads": None,
}

# Per-layer CT2 module (under {encoder,decoder}/layer_{i}/) -> HF modules fused in it, in order.
_LAYER_LINEARS: dict[str, tuple[str, ...]] = {
    "self_attention/linear_0": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention/linear_1": ("self_attn.out_proj",),
    "attention/linear_0": ("encoder_attn.q_proj",),
    "attention/linear_1": ("encoder_attn.k_proj", "encoder_attn.v_proj"),
    "attention/linear_2": ("encoder_attn.out_proj",),
    "ffn/linear_0": ("fc1",),
    "ffn/linear_1": ("fc2",),
}
_LAYER_NORMS: dict[str, str] = {
    "self_attention/layer_norm": "self_attn_layer_norm",
    "attention/layer_norm": "encoder_attn_layer_norm",
    "ffn/layer_norm": "final_layer_norm",
}
_DECODER_ONLY = "attention/"  # cross-attention modules exist in decoder layers only
_NORM_LEAF = {"gamma": "weight", "beta": "bias"}
_LAYER_RE = re.compile(r"(encoder|decoder)/layer_(\d+)/(.+)/(weight|bias|gamma|beta)")
# Variables outside the layers -> HF names.
_TOP_LEVEL: dict[str, str] = {
    **{f"encoder/{c}/{leaf}": f"model.encoder.{c}.{leaf}"
       for c in ("conv1", "conv2") for leaf in ("weight", "bias")},
    **{f"{s}/position_encodings/encodings": f"model.{s}.embed_positions.weight"
       for s in ("encoder", "decoder")},
    **{f"{s}/layer_norm/{ct2}": f"model.{s}.layer_norm.{hf}"
       for s in ("encoder", "decoder") for ct2, hf in _NORM_LEAF.items()},
    "decoder/embeddings/weight": "model.decoder.embed_tokens.weight",
}
_TIED = ("decoder/projection/weight", "decoder/embeddings/weight")


def _float_tensor(model: CT2Model, name: str) -> torch.Tensor:
    """Variable ``name`` as float32, undoing int8/int16 quantisation via ``<name>_scale``."""
    tensor = model.tensor(name)
    scale_name = f"{name}_scale"
    if scale_name in model:
        scale = model.tensor(scale_name)
        if scale.ndim == 1:  # int8: one scale per output row
            scale = scale.reshape(-1, *([1] * (tensor.ndim - 1)))
        tensor = tensor / scale
    elif model.dtype(name) in ("int8", "int16"):
        raise ValueError(f"quantised CTranslate2 variable {name!r} has no {scale_name!r}")
    return tensor


def _split_fused(
    tensor: torch.Tensor, modules: tuple[str, ...], leaf: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Split a fused weight/bias along rows into ``modules`` (k_proj biases are dropped)."""
    if tensor.shape[0] % len(modules):
        raise ValueError(f"cannot split {tuple(tensor.shape)} into {len(modules)} parts")
    for module, part in zip(modules, tensor.chunk(len(modules), dim=0), strict=True):
        if leaf == "bias" and module.endswith("k_proj"):
            continue  # HF k_proj has no bias; CT2 stores zeros here (softmax-invariant anyway)
        yield f"{module}.{leaf}", part.contiguous()


def _map_whisper_variable(model: CT2Model, name: str) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for CT2 variable ``name``; [] for config-only or tied entries."""
    if name in _WHISPER_SCALARS:
        required = _WHISPER_SCALARS[name]
        if required is not None and model.scalar(name) != required:
            raise ValueError(f"{name} = {model.scalar(name)} is not supported (need {required})")
        return []
    if name.endswith("_scale") and name.removesuffix("_scale") in model:
        return []  # consumed by _float_tensor
    if name in _TOP_LEVEL:
        return [(_TOP_LEVEL[name], _float_tensor(model, name))]
    if name == _TIED[0]:
        same = model.resolve(name) == model.resolve(_TIED[1])
        if not (same or torch.equal(_float_tensor(model, name), _float_tensor(model, _TIED[1]))):
            raise ValueError(f"{name} differs from the token embeddings (untied projection)")
        return []  # HF ties proj_out to model.decoder.embed_tokens
    match = _LAYER_RE.fullmatch(name)
    if match and not (match[1] == "encoder" and match[3].startswith(_DECODER_ONLY)):
        stack, index, module, leaf = match.groups()
        prefix = f"model.{stack}.layers.{index}."
        if module in _LAYER_LINEARS and leaf in ("weight", "bias"):
            parts = _split_fused(_float_tensor(model, name), _LAYER_LINEARS[module], leaf)
            return [(prefix + hf_name, tensor) for hf_name, tensor in parts]
        if module in _LAYER_NORMS and leaf in _NORM_LEAF:
            hf_name = f"{prefix}{_LAYER_NORMS[module]}.{_NORM_LEAF[leaf]}"
            return [(hf_name, _float_tensor(model, name))]
    raise KeyError(f"unmapped CTranslate2 Whisper variable {name!r}")


def _count_layers(model: CT2Model, stack: str) -> int:
    pattern = re.compile(rf"{stack}/layer_(\d+)/")
    indices = {int(m.group(1)) for n in model.names() if (m := pattern.match(n))}
    if indices != set(range(len(indices))):
        raise ValueError(f"{stack} layer indices are not contiguous: {sorted(indices)}")
    return len(indices)


def whisper_hf_names(config: Mapping[str, Any]) -> set[str]:
    """HF WhisperForConditionalGeneration state-dict keys for ``config`` (minus tied proj_out)."""
    names = set(_TOP_LEVEL.values())
    for stack in ("encoder", "decoder"):
        keep = stack == "decoder"
        modules = [m for ct2, fused in _LAYER_LINEARS.items() for m in fused
                   if keep or not ct2.startswith(_DECODER_ONLY)]
        norms = [m for ct2, m in _LAYER_NORMS.items() if keep or not ct2.startswith(_DECODER_ONLY)]
        for i in range(config[f"{stack}_layers"]):
            prefix = f"model.{stack}.layers.{i}."
            names |= {f"{prefix}{m}.weight" for m in modules + norms}
            names |= {f"{prefix}{m}.bias" for m in modules + norms if not m.endswith("k_proj")}
    return names


def whisper_hf_tensors(model: CT2Model) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every weight of a CTranslate2 Whisper model.

    Raises KeyError naming any CT2 variable/alias that has no mapping, and ValueError if some
    HF weight expected for the model's shape was not produced (checked after the last yield).
    """
    if model.spec_name != "WhisperSpec":
        raise ValueError(f"not a CTranslate2 Whisper model: spec {model.spec_name!r}")
    layers = {f"{s}_layers": _count_layers(model, s) for s in ("encoder", "decoder")}
    expected = whisper_hf_names(layers)
    produced: set[str] = set()
    for name in model.names():
        for hf_name, tensor in _map_whisper_variable(model, name):
            if hf_name in produced:
                raise ValueError(f"{hf_name} produced twice (last from {name!r})")
            if hf_name not in expected:
                raise KeyError(f"CTranslate2 variable {name!r} maps to unexpected {hf_name!r}")
            produced.add(hf_name)
            yield hf_name, tensor
    missing = expected - produced
    if missing:
        raise ValueError(f"CTranslate2 Whisper model lacks weights for: {sorted(missing)}")


def _token_ids(config_json: Mapping[str, Any]) -> tuple[int, int]:
    """(<|endoftext|>, <|startoftranscript|>) ids from a CT2 Whisper config.json.

    ``suppress_ids_begin`` is ``[220 (" "), <|endoftext|>]`` and ``<|startoftranscript|>``
    directly follows ``<|endoftext|>``; the language tokens (if any) directly follow it.
    """
    begin = [int(i) for i in config_json.get("suppress_ids_begin") or [] if int(i) != 220]
    if len(begin) != 1:
        raise ValueError(f"cannot find <|endoftext|> in suppress_ids_begin={begin}")
    eot = begin[0]
    sot = eot + 1
    lang_ids = config_json.get("lang_ids") or []
    if lang_ids and min(lang_ids) != sot + 1:
        raise ValueError(f"lang_ids start at {min(lang_ids)}, expected {sot + 1} after SOT={sot}")
    return eot, sot


def whisper_config_from_ct2(model: CT2Model, config_json: Mapping[str, Any]) -> dict[str, Any]:
    """An HF ``WhisperConfig`` keyword dict derived from tensor shapes, scalars and config.json."""

    def dim(name: str, axis: int) -> int:
        return int(model.variables[model.resolve(name)].shape[axis])

    eot, sot = _token_ids(config_json)
    return {
        "vocab_size": dim("decoder/embeddings/weight", 0),
        "num_mel_bins": dim("encoder/conv1/weight", 1),
        "d_model": dim("decoder/embeddings/weight", 1),
        "encoder_layers": _count_layers(model, "encoder"),
        "decoder_layers": _count_layers(model, "decoder"),
        "encoder_attention_heads": int(model.scalar("encoder/num_heads")),
        "decoder_attention_heads": int(model.scalar("decoder/num_heads")),
        "encoder_ffn_dim": dim("encoder/layer_0/ffn/linear_0/weight", 0),
        "decoder_ffn_dim": dim("decoder/layer_0/ffn/linear_0/weight", 0),
        "max_source_positions": dim("encoder/position_encodings/encodings", 0),
        "max_target_positions": dim("decoder/position_encodings/encodings", 0),
        "activation_function": "gelu",
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "pad_token_id": eot,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "decoder_start_token_id": sot,
        "suppress_tokens": [int(i) for i in config_json.get("suppress_ids") or []],
        "begin_suppress_tokens": [int(i) for i in config_json.get("suppress_ids_begin") or []],
    }
