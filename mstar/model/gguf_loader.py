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

__all__ = [
    "GGUFCheckpoint",
    "llama_config_from_gguf",
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
        self._reader = gguf.GGUFReader(self.path)
        # "GGUF.*" entries are the file header (version, counts), not key/value metadata.
        self.metadata: dict[str, Any] = {
            key: field.contents()
            for key, field in self._reader.fields.items()
            if not key.startswith("GGUF.")
        }

    @property
    def architecture(self) -> str:
        return str(self.metadata.get(gguf.Keys.General.ARCHITECTURE, ""))

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self._reader.tensors]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(gguf_name, tensor)``, dequantised to float32 in PyTorch ``[out, in]`` layout."""
        for t in self._reader.tensors:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = tuple(int(n) for n in reversed(t.shape))  # GGML ne[0] is the innermost dim
            # Copies only what is not already a fresh float32 array (e.g. F32 views of the file).
            array = np.require(values, dtype=np.float32, requirements=["C", "W"])
            yield t.name, torch.from_numpy(array.reshape(shape))


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


def llama_hf_tensors(checkpoint: GGUFCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for a Llama GGUF, Q/K rows back in Hugging Face order.

    Feed the result to ``load_weights``. Derived tensors are dropped; unknown ones pass through
    under their GGUF names.
    """
    arch = checkpoint.architecture
    n_heads = int(checkpoint.metadata[gguf.Keys.Attention.HEAD_COUNT.format(arch=arch)])
    n_kv_heads = int(
        checkpoint.metadata.get(gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=arch), n_heads)
    )
    for gguf_name, tensor in checkpoint.tensors():
        name = llama_name_map(gguf_name)
        if name is None:
            continue
        if ".self_attn.q_proj." in name:
            tensor = unpermute_rotary(tensor, n_heads)
        elif ".self_attn.k_proj." in name:
            tensor = unpermute_rotary(tensor, n_kv_heads)
        yield name, tensor


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
