"""Reading llama.cpp GGUF checkpoints: metadata, dequantised tensors, config and tokenizer.

Typical use for a Llama-architecture file::

    ckpt = GGUFCheckpoint(path)
    config = llama_config_from_gguf(ckpt.metadata, ckpt.tensor_names)
    model = LlamaForCausalLM(LlamaConfig.from_hf_dict(config))
    load_weights(model, llama_hf_tensors(ckpt))
    tokenizer = tokenizer_from_gguf(ckpt.metadata)

Two llama.cpp conventions are undone here. Its converter stores each 2-D weight in the PyTorch
``[out, in]`` order (GGML's ``ne`` lists the same shape reversed), and it permutes the rows of
``attn_q`` / ``attn_k`` within every head from Hugging Face's rotate-half RoPE layout (first half
of the head = real parts, second half = imaginary parts) to GGML's interleaved pairs
(row ``2*j + s`` holds what HF keeps at row ``s*head_dim/2 + j``); ``unpermute_rotary`` inverts it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)
from transformers import PreTrainedTokenizerFast

from mstar.model.gguf_file import read_gguf

__all__ = [
    "GGUFBlocks",
    "GGUFCheckpoint",
    "llama_config_from_gguf",
    "llama_hf_blocks",
    "llama_hf_tensors",
    "llama_name_map",
    "tokenizer_from_gguf",
    "unpermute_rotary",
]

logger = logging.getLogger(__name__)


class GGUFCheckpoint:
    """A GGUF file: its key/value metadata as plain Python values, and its tensors as float32."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        self._file = read_gguf(self.path)
        self.metadata: dict[str, Any] = self._file.metadata

    @property
    def architecture(self) -> str:
        return str(self.metadata.get(gguf.Keys.General.ARCHITECTURE, ""))

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self._file.tensors]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(gguf_name, tensor)``, dequantised to float32 in PyTorch ``[out, in]`` layout."""
        for t in self._file.tensors:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = tuple(int(n) for n in reversed(t.shape))  # GGML ne[0] is the innermost dim
            # Copies only what is not already a fresh float32 array (e.g. F32 views of the file).
            array = np.require(values, dtype=np.float32, requirements=["C", "W"])
            yield t.name, torch.from_numpy(array.reshape(shape))


    def blocks(self) -> Iterator[tuple[str, GGUFBlocks]]:
        """Yield ``(gguf_name, blocks)`` for the tensors stored as Q4_0, Q4_1 or Q8_0 (the others
        have no ``GGUFBlocks`` form), codes and scales in PyTorch ``[out, in]`` row order."""
        for t in self._file.tensors:
            if t.tensor_type in _BLOCK_DECODERS and len(t.shape) == 2:
                cols, rows = (int(n) for n in t.shape)  # GGML ne[0] is the innermost dim
                raw = np.asarray(t.data).reshape(rows, cols // GGUF_BLOCK, -1)  # [rows, blocks, bytes]
                yield t.name, _BLOCK_DECODERS[t.tensor_type](raw)


# --- Quantised blocks ------------------------------------------------------------------------

GGUF_BLOCK = 32
"""Weights per block of the Q4_0, Q4_1 and Q8_0 formats (each block has its own scale)."""


@dataclass
class GGUFBlocks:
    """A matrix in one of GGUF's block formats, unpacked but not dequantised: ``w[n, k] =
    scale[n, k // 32] * codes[n, k] + offset[n, k // 32]``.

    * Q4_1: codes 0..15, ``offset`` the block's minimum (``kind="q4"``);
    * Q4_0: codes 0..15, ``offset = -8 * scale`` (``kind="q4"``);
    * Q8_0: codes -128..127, no offset (``kind="q8"``).

    Every field is indexed by rows first, so a row permutation or a row split applies to each."""

    kind: str  # "q4" or "q8"
    codes: torch.Tensor  # uint8 (q4) or int8 (q8) [rows, cols]
    scale: torch.Tensor  # float32 [rows, cols / 32]
    offset: torch.Tensor | None  # float32 [rows, cols / 32] (q4), None (q8)

    def map_rows(self, fn) -> GGUFBlocks:
        """The same blocks with ``fn`` (a row permutation or selection) applied to every field."""
        offset = None if self.offset is None else fn(self.offset)
        return GGUFBlocks(self.kind, fn(self.codes), fn(self.scale), offset)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix (as ``gguf.quants.dequantize`` gives it)."""
        w = self.codes.float().unflatten(-1, (-1, GGUF_BLOCK)) * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.flatten(-2)


def _half(raw: np.ndarray) -> torch.Tensor:
    """Little-endian float16 bytes ``[..., 2]`` as float32 ``[...]``."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(raw: np.ndarray) -> torch.Tensor:
    """A block's 16 bytes as its 32 4-bit codes: byte ``j`` holds code ``j`` in its low nibble
    and code ``j + 16`` in its high one."""
    low, high = raw & 0x0F, raw >> 4
    return torch.from_numpy(np.concatenate([low, high], axis=-1)).flatten(-2)


def _q4_0(raw: np.ndarray) -> GGUFBlocks:  # per block: float16 d, 16 bytes of codes; w = d * (q - 8)
    scale = _half(raw[..., 0:2])
    return GGUFBlocks("q4", _nibbles(raw[..., 2:18]), scale, -8 * scale)


def _q4_1(raw: np.ndarray) -> GGUFBlocks:  # per block: float16 d, float16 m, 16 bytes; w = d * q + m
    return GGUFBlocks("q4", _nibbles(raw[..., 4:20]), _half(raw[..., 0:2]), _half(raw[..., 2:4]))


def _q8_0(raw: np.ndarray) -> GGUFBlocks:  # per block: float16 d, 32 int8 codes; w = d * q
    codes = torch.from_numpy(np.ascontiguousarray(raw[..., 2:34]).view(np.int8)).flatten(-2)
    return GGUFBlocks("q8", codes, _half(raw[..., 0:2]), None)


_BLOCK_DECODERS = {
    gguf.GGMLQuantizationType.Q4_0: _q4_0,
    gguf.GGMLQuantizationType.Q4_1: _q4_1,
    gguf.GGMLQuantizationType.Q8_0: _q8_0,
}


# --- Llama weights ---------------------------------------------------------------------------

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp derives from the config (Llama 3.1 RoPE frequency factors): nothing to load.
_DERIVED = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def llama_name_map(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF Llama tensor name (names only: see ``llama_hf_tensors``).

    Returns ``None`` for tensors that carry nothing to load, and unknown names unchanged (so a
    strict ``load_weights`` reports them).
    """
    if gguf_name in _DERIVED:
        return None
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif m := _GLOBAL_RE.fullmatch(gguf_name):
        part, kind = m.groups()
        if part in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[part]}.{kind}"
    return gguf_name


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleaving of a Q or K projection (weight or bias).

    Within each head of ``head_dim`` rows, GGUF row ``2*j + s`` (``s`` in {0, 1},
    ``j < head_dim/2``) goes back to HF row ``s*head_dim/2 + j``. ``n_heads`` is the number of
    heads the rows belong to: ``num_attention_heads`` for Q, ``num_key_value_heads`` for K.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    return (
        weight.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)
    )


def _rotary_heads(checkpoint: GGUFCheckpoint):
    """name -> the head count whose rows GGUF permuted for its rotary layout (q_proj: the
    attention heads, k_proj: the KV heads), or None for a tensor left as it is."""
    n_heads, n_kv_heads = _head_counts(checkpoint)
    return lambda name: (n_heads if ".self_attn.q_proj." in name else
                         n_kv_heads if ".self_attn.k_proj." in name else None)


def llama_hf_tensors(checkpoint: GGUFCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for a Llama GGUF, Q/K rows back in Hugging Face order.

    Feed the result to ``load_weights``. Derived tensors are dropped; unknown ones pass through
    under their GGUF names.
    """
    heads = _rotary_heads(checkpoint)
    for gguf_name, tensor in checkpoint.tensors():
        name = llama_name_map(gguf_name)
        if name is None:
            continue
        if (n := heads(name)) is not None:
            tensor = unpermute_rotary(tensor, n)
        yield name, tensor


def llama_hf_blocks(checkpoint: GGUFCheckpoint) -> Iterator[tuple[str, GGUFBlocks]]:
    """``llama_hf_tensors`` for the block-quantised matrices: ``(hf_name, GGUFBlocks)``, Q/K
    rows back in Hugging Face order (``mstar.model.quantize`` keeps them quantised)."""
    heads = _rotary_heads(checkpoint)
    for gguf_name, blocks in checkpoint.blocks():
        name = llama_name_map(gguf_name)
        if name is None:
            continue
        if (n := heads(name)) is not None:
            blocks = blocks.map_rows(lambda t, n=n: unpermute_rotary(t, n))
        yield name, blocks


def _head_counts(checkpoint: GGUFCheckpoint) -> tuple[int, int]:
    arch = checkpoint.architecture
    n_heads = int(checkpoint.metadata[gguf.Keys.Attention.HEAD_COUNT.format(arch=arch)])
    n_kv_heads = int(
        checkpoint.metadata.get(gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=arch), n_heads)
    )
    return n_heads, n_kv_heads


def llama_config_from_gguf(
    metadata: Mapping[str, Any], tensor_names: Collection[str]
) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict for a Llama-architecture GGUF.

    ``tensor_names`` (``GGUFCheckpoint.tensor_names``) decides ``tie_word_embeddings``: the
    embeddings are tied exactly when the file has no ``output.weight``.
    """
    arch = str(metadata.get(gguf.Keys.General.ARCHITECTURE, ""))
    if arch != "llama":
        raise ValueError(f"expected a llama-architecture GGUF, got general.architecture={arch!r}")

    def key(template: str) -> str:
        return template.format(arch=arch)

    def required(template: str) -> Any:
        if key(template) not in metadata:
            raise KeyError(f"GGUF metadata lacks {key(template)!r}")
        return metadata[key(template)]

    hidden = int(required(gguf.Keys.LLM.EMBEDDING_LENGTH))
    n_heads = int(required(gguf.Keys.Attention.HEAD_COUNT))
    n_kv_heads = metadata.get(key(gguf.Keys.Attention.HEAD_COUNT_KV), n_heads)
    if not isinstance(n_kv_heads, int):
        raise NotImplementedError(f"per-layer head_count_kv {n_kv_heads!r} is not supported")
    head_dim = metadata.get(
        key(gguf.Keys.Rope.DIMENSION_COUNT),
        metadata.get(key(gguf.Keys.Attention.KEY_LENGTH), hidden // n_heads),
    )
    vocab = metadata.get(key(gguf.Keys.LLM.VOCAB_SIZE))
    if vocab is None:
        vocab = len(metadata[gguf.Keys.Tokenizer.LIST])
    names = set(tensor_names)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(required(gguf.Keys.LLM.FEED_FORWARD_LENGTH)),
        "num_hidden_layers": int(required(gguf.Keys.LLM.BLOCK_COUNT)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv_heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(required(gguf.Keys.Attention.LAYERNORM_RMS_EPS)),
        "rope_theta": float(metadata.get(key(gguf.Keys.Rope.FREQ_BASE), 10000.0)),
        "max_position_embeddings": int(metadata.get(key(gguf.Keys.LLM.CONTEXT_LENGTH), 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "hidden_act": "silu",
    }
    if metadata.get(key(gguf.Keys.Rope.SCALING_TYPE)) == "linear":
        factor = float(metadata[key(gguf.Keys.Rope.SCALING_FACTOR)])
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    for name, gguf_key in (
        ("bos_token_id", gguf.Keys.Tokenizer.BOS_ID),
        ("eos_token_id", gguf.Keys.Tokenizer.EOS_ID),
        ("pad_token_id", gguf.Keys.Tokenizer.PAD_ID),
    ):
        if gguf_key in metadata:
            config[name] = int(metadata[gguf_key])
    return config


# --- Tokenizer -------------------------------------------------------------------------------

# The split llama.cpp applies for "llama-bpe" (Llama 3): the tiktoken cl100k pattern.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str | None, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for a ``tokenizer.ggml.pre`` value."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre == "smollm":
        # SmolLM's own tokenizer.json: single digits, then the GPT-2 split. Its vocabulary has no
        # multi-digit tokens, so this encodes exactly like transformers' plain GPT-2 split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    if pre not in (None, "default", "gpt2", "gpt-2"):
        logger.warning("GGUF tokenizer.ggml.pre=%r is not known here; using the GPT-2 split", pre)
    return gpt2


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> PreTrainedTokenizerFast:
    """A fast byte-level BPE tokenizer built from a GGUF's ``tokenizer.*`` metadata.

    Control tokens (token type 3) become special added tokens, user-defined ones (type 4) plain
    added tokens, so both are matched whole; bos/eos/unk/pad and the chat template are set.
    """
    T = gguf.Keys.Tokenizer
    kind = metadata.get(T.MODEL)
    if kind != "gpt2":
        raise NotImplementedError(
            f"only byte-level BPE GGUF tokenizers (tokenizer.ggml.model='gpt2') are supported, "
            f"got {kind!r}"
        )
    tokens: list[str] = list(metadata[T.LIST])
    merges = [tuple(m.split(" ", 1)) for m in metadata[T.MERGES]]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    add_prefix_space = bool(metadata.get(T.ADD_PREFIX, False))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get(T.PRE), add_prefix_space)
    backend.decoder = decoders.ByteLevel()

    types = metadata.get(T.TOKEN_TYPE) or []
    special = [tokens[i] for i, t in enumerate(types) if t == gguf.TokenType.CONTROL]
    user = [tokens[i] for i, t in enumerate(types) if t == gguf.TokenType.USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token(id_key: str) -> str | None:
        index = metadata.get(id_key)
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos, eos = token(T.BOS_ID), token(T.EOS_ID)
    add_bos = bool(metadata.get(T.ADD_BOS, False)) and bos is not None
    add_eos = bool(metadata.get(T.ADD_EOS, False)) and eos is not None
    if add_bos or add_eos:

        def template(sequence: str, type_id: int) -> list[str]:
            head = [f"{bos}:{type_id}"] if add_bos else []
            tail = [f"{eos}:{type_id}"] if add_eos else []
            return [*head, f"${sequence}:{type_id}", *tail]

        specials = {t: vocab[t] for t, on in ((bos, add_bos), (eos, add_eos)) if on and t}
        backend.post_processor = processors.TemplateProcessing(
            single=template("A", 0),
            pair=template("A", 0) + template("B", 1),
            special_tokens=list(specials.items()),
        )

    kwargs: dict[str, Any] = {}
    arch = metadata.get(gguf.Keys.General.ARCHITECTURE)
    context = metadata.get(f"{arch}.context_length") if arch else None
    if context:
        kwargs["model_max_length"] = int(context)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token(T.UNK_ID),
        pad_token=token(T.PAD_ID),
        chat_template=metadata.get(T.CHAT_TEMPLATE),
        clean_up_tokenization_spaces=False,
        **kwargs,
    )
