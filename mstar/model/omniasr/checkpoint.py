"""Where an Omnilingual ASR CTC checkpoint's weights and vocabulary come from.

Two layouts load:

- the release's (``weights_version: v1``, the ``facebook/omniASR-CTC-*`` Hub repos, or Meta's
  ``.pt`` files given as ``checkpoint_path``): fairseq2's state dict, whose names are our
  parameter names, in one PyTorch file (at the top level or under ``"model"``) or in
  safetensors with no ``config.json`` beside them, and a SentencePiece tokenizer (``*.model``);
- transformers' (``OmniASRForCTC``): ``config.json``, safetensors and ``tokenizer.json``. Its
  names are mapped onto ours (``hf_name``), and its position convolution, stored with the weight
  norm folded in, is split back into a direction and a per-tap norm (``from_hf_layout``), which
  fold to the same weight.

The architecture comes from ``config.json`` when there is one, else from the size the key
names; the vocabulary size from the tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.model.omniasr.config import SIZES, OmniAsrConfig
from mstar.model.omniasr.modeling import OmniAsrCtc
from mstar.model.omniasr.vocabulary import CtcVocabulary

_HF_PREFIX = "model.audio_tower."
_HF_RULES = (  # (transformers' name pattern, ours), tried in order on the name less its prefix
    (r"subsampling\.conv_layers\.(\d+)\.(conv|layer_norm)\.", r"encoder_frontend.feature_extractor.layers.\1.\2."),
    (r"subsampling\.layer_norm\.", "encoder_frontend.post_extract_layer_norm."),
    (r"subsampling\.projection\.", "encoder_frontend.model_dim_proj."),
    (r"encode_positions\.conv\.bias", "encoder_frontend.pos_encoder.conv.bias"),
    (r"encode_positions\.conv\.weight", "encoder_frontend.pos_encoder.conv.weight"),
    (r"layers\.(\d+)\.attention\.out_proj\.", r"encoder.layers.\1.self_attn.output_proj."),
    (r"layers\.(\d+)\.attention\.", r"encoder.layers.\1.self_attn."),
    (r"layers\.(\d+)\.layer_norm\.", r"encoder.layers.\1.self_attn_layer_norm."),
    (r"layers\.(\d+)\.final_layer_norm\.", r"encoder.layers.\1.ffn_layer_norm."),
    (r"layers\.(\d+)\.feed_forward\.intermediate_dense\.", r"encoder.layers.\1.ffn.inner_proj."),
    (r"layers\.(\d+)\.feed_forward\.output_dense\.", r"encoder.layers.\1.ffn.output_proj."),
    (r"layer_norm\.", "encoder.layer_norm."),
)


def hf_name(name: str) -> str:
    """Our name for transformers' ``name`` (unchanged when it matches no rule: coverage then
    names it)."""
    if name.startswith("ctc_head."):
        return "final_proj." + name[len("ctc_head."):]
    if not name.startswith(_HF_PREFIX):
        return name
    rest = name[len(_HF_PREFIX):]
    for pattern, ours in _HF_RULES:
        renamed, hits = re.subn("^" + pattern, ours, rest)
        if hits:
            return renamed
    return name


def from_hf_layout(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' tensors under our names; the folded position-convolution weight becomes
    ``weight_v`` (itself) and ``weight_g`` (its norm over all but the tap axis)."""
    for name, tensor in tensors:
        ours = hf_name(name)
        if ours == "encoder_frontend.pos_encoder.conv.weight":
            yield ours + "_v", tensor
            yield ours + "_g", tensor.float().norm(dim=(0, 1), keepdim=True).to(tensor.dtype)
        else:
            yield ours, tensor


def read_release_state(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a release ``.pt`` (fairseq2 keeps it under ``"model"``)."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a state dict")
    return {name: t for name, t in state.items() if isinstance(t, torch.Tensor)}


@dataclass
class OmniAsrCheckpoint:
    """``weights``: a release ``.pt`` or a transformers directory (None: dummy weights only);
    ``tokenizer``: ``*.model`` or ``tokenizer.json`` (None: a synthetic vocabulary)."""

    size: str
    weights: Path | None = None
    tokenizer: Path | None = None

    @classmethod
    def locate(cls, size: str, path: str | None, *, tokenizer_path: str | None = None,
               cache_dir: str | None = None) -> OmniAsrCheckpoint:
        """From a local file or directory, or a Hub id (resolved through the hub cache)."""
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; one of {', '.join(SIZES)}")
        if path is None:
            return cls(size, None, Path(tokenizer_path) if tokenizer_path else None)
        from mstar.model.weights import resolve_model_path

        local = resolve_model_path(path, cache_dir=cache_dir)
        weights, tokenizer = local, Path(tokenizer_path) if tokenizer_path else None
        if local.is_dir():
            if not (local / "config.json").is_file():
                found = sorted(local.glob("*.pt"))
                if len(found) > 1 or not (found or any(local.glob("*.safetensors"))):
                    raise ValueError(f"{local}: expected one .pt checkpoint, safetensors, or a transformers "
                                     f"config.json; found {[p.name for p in found]}")
                weights = found[0] if found else local
            if tokenizer is None:
                found = sorted(local.glob("*.model")) or sorted(local.glob("tokenizer.json"))
                tokenizer = found[0] if found else None
        elif tokenizer is None:
            found = sorted(local.parent.glob("*.model"))
            tokenizer = found[0] if found else None
        return cls(size, weights, tokenizer)

    @property
    def hf_layout(self) -> bool:
        """transformers' layout (a directory with ``config.json``)."""
        return self.weights is not None and (self.weights / "config.json").is_file()

    def vocabulary(self, vocab_size: int | None = None) -> CtcVocabulary:
        if self.tokenizer is None:
            return CtcVocabulary.synthetic(vocab_size or SIZES[self.size].vocab_size)
        if self.tokenizer.suffix == ".json":
            return CtcVocabulary.from_tokenizer_json(self.tokenizer)
        return CtcVocabulary.from_sentencepiece(self.tokenizer)

    def config(self, base: OmniAsrConfig | None = None) -> OmniAsrConfig:
        """The architecture: transformers' ``config.json``, else ``base`` (default: the size's)
        with the tokenizer's vocabulary size."""
        if self.hf_layout:
            return OmniAsrConfig.from_hf_dict(json.loads((self.weights / "config.json").read_text()))
        config = base or SIZES[self.size]
        return config.with_vocab(len(self.vocabulary(config.vocab_size))) if self.tokenizer else config

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.weights is None:
            raise ValueError("no checkpoint: give model_kwargs.checkpoint_path or weights_version, or "
                             "load_format: dummy")
        if self.weights.is_dir():
            from mstar.model.weights import iter_safetensors

            tensors = iter_safetensors(self.weights)
            return from_hf_layout(tensors) if self.hf_layout else tensors
        return iter(read_release_state(self.weights).items())

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int,
                   config: OmniAsrConfig | None = None) -> OmniAsrCtc:
        """The model on ``device`` in ``dtype``: the checkpoint's tensors (coverage checked both
        ways; the release's training counter is skipped) or seeded random weights (``dummy``)."""
        from mstar.model.weights import building, fill_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = OmniAsrCtc(config or self.config())
        skip = {"num_updates", "encoder_frontend.num_updates"}
        return fill_weights(model, self.tensors, dummy=dummy, seed=seed, dtype=dtype,
                            name_map=lambda name: None if name in skip else name)
