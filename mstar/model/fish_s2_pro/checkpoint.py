"""The released Fish S2-Pro files, and the models built from them or from dummy weights.

The layout is fish-speech's: ``config.json`` (``DualARModelArgs``), the dual AR's tensors in
``model.pth`` or ``*.safetensors`` (a ``model.`` prefix, from a training checkpoint, is
dropped), the tokenizer's special tokens (``special_tokens.json``, else ``tokenizer.json``'s
added tokens) giving ``<|semantic:0|>`` and ``<|im_end|>``, and the codec in ``codec.pth``
(its ``generator.`` prefix dropped). Coverage is checked both ways: a model parameter no
tensor fills, or a tensor that fills nothing, fails the load naming it.

The codec's sizes are not in the release (fish-speech keeps them in ``modded_dac_vq.yaml``):
they are ``CodecConfig``'s and ``EncoderConfig``'s defaults, unless a ``codec.json`` beside the
weights gives others (``CodecConfig`` fields, and the encoder's under ``"encoder"``), as a
small test release does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from mstar.model.fish_s2_pro.codec import CodecConfig, CodecDecoder
from mstar.model.fish_s2_pro.codec_encoder import CodecEncoder, EncoderConfig
from mstar.model.fish_s2_pro.config import DualARConfig
from mstar.model.fish_s2_pro.dual_ar import DualAR
from mstar.model.fish_s2_pro.weights import codec_encoder_tensors, codec_tensors, dual_ar_tensors
from mstar.model.weights import building, fill_weights, iter_safetensors, resolve_model_path

SEMANTIC_ZERO = "<|semantic:0|>"
IM_END = "<|im_end|>"


def _torch_file(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    tensors = tensors.get("state_dict", tensors)
    if tensors and all(name.startswith(prefix) for name in tensors):
        tensors = {name[len(prefix):]: t for name, t in tensors.items()}
    return dict(tensors)


def _known(cls: type, values: dict) -> dict:
    """``values`` for the dataclass ``cls``: lists as tuples; an unknown key raises, naming it."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise KeyError(f"codec.json: unknown {cls.__name__} keys {unknown}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


@dataclass
class FishS2ProCheckpoint:
    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> FishS2ProCheckpoint:
        return cls(resolve_model_path(model_path, cache_dir))

    def special_tokens(self) -> dict[str, int]:
        special = self.path / "special_tokens.json"
        if special.exists():
            return json.loads(special.read_text())
        added = json.loads((self.path / "tokenizer.json").read_text()).get("added_tokens", [])
        return {token["content"]: token["id"] for token in added}

    def config(self) -> DualARConfig:
        """The dual AR's config; ``<|semantic:0|>`` from the config (S2's
        ``semantic_start_token_id``) or else the tokenizer, ``<|im_end|>`` from the tokenizer."""
        raw = json.loads((self.path / "config.json").read_text())
        tokens = self.special_tokens()
        ids = {"eos_token_id": IM_END}
        if "semantic_start_token_id" not in raw:
            ids["semantic_begin_id"] = SEMANTIC_ZERO
        for name in ids.values():
            if name not in tokens:
                raise KeyError(f"{self.path}: the tokenizer has no {name} token")
        return DualARConfig.from_dict({**raw, **{key: tokens[name] for key, name in ids.items()}})

    def codec_configs(self) -> tuple[CodecConfig, EncoderConfig]:
        """The codec's decoder and encoder sizes (``codec.json``, else the release's)."""
        path = self.path / "codec.json"
        raw = json.loads(path.read_text()) if path.exists() else {}
        encoder = raw.pop("encoder", {})
        return CodecConfig(**_known(CodecConfig, raw)), EncoderConfig(**_known(EncoderConfig, encoder))

    def tokenizer(self):
        """The text tokenizer (``tokenizer.json``): ``encode(text, add_special_tokens=False)``
        gives ids, the chat's special tokens matched whole."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=str(self.path / "tokenizer.json"))

    def dual_ar_released(self) -> dict[str, torch.Tensor]:
        if (self.path / "model.pth").exists():
            return _torch_file(self.path / "model.pth", "model.")
        return dict(iter_safetensors(self.path))

    def dual_ar(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int,
                config: DualARConfig | None = None) -> DualAR:
        config = config or self.config()
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = DualAR(config)

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            yield from dual_ar_tensors(config, self.dual_ar_released()).items()

        return fill_weights(model, tensors, dummy=dummy, seed=seed)

    def codec(self, device: torch.device, *, dummy: bool, seed: int,
              config: CodecConfig | None = None) -> CodecDecoder:
        """The codec decoder in fp32 (its numerics are the reference's only there)."""
        with torch.device(device):
            codec = CodecDecoder(config or CodecConfig())

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            released = _torch_file(self.path / "codec.pth", "generator.")
            yield from codec_tensors(released, set(codec.state_dict())).items()

        return fill_weights(codec, tensors, dummy=dummy, seed=seed)

    def codec_encoder(self, device: torch.device, *, dummy: bool, seed: int, config: CodecConfig | None = None,
                      encoder: EncoderConfig | None = None) -> CodecEncoder:
        """The codec's encode side (reference clips to codes), fp32."""
        with torch.device(device):
            module = CodecEncoder(encoder or EncoderConfig(), config or CodecConfig())

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            released = _torch_file(self.path / "codec.pth", "generator.")
            yield from codec_encoder_tensors(released, set(module.state_dict())).items()

        return fill_weights(module, tensors, dummy=dummy, seed=seed)
