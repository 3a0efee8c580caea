"""Where a Qwen3-TTS 12 Hz checkpoint's parts come from, and their weight-name maps.

The released layout: ``config.json`` (``talker_config``, ``speaker_encoder_config``,
``tts_model_type``), the text tokenizer files, ``model.safetensors`` (``talker.`` keys and, on
the base checkpoints, ``speaker_encoder.``), and ``speech_tokenizer/`` with the 12 Hz codec's
own ``config.json`` and ``model.safetensors`` (``encoder.`` and ``decoder.`` keys). Every part
loads with coverage both ways (``mstar.model.weights.load_weights``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.model.qwen3_tts.codec import Qwen3TTSCodec
from mstar.model.qwen3_tts.codec_encoder import EncoderConfig, Qwen3TTSCodecEncoder
from mstar.model.qwen3_tts.config import CodecConfig, Qwen3TTSConfig
from mstar.model.qwen3_tts.speaker import Qwen3TTSSpeakerEncoder
from mstar.model.qwen3_tts.talker import Qwen3TTSTalker
from mstar.model.weights import building, fill_weights, init_dummy_weights, iter_safetensors, load_weights

TALKER, CODEC, SPEAKER, ENCODER = "talker.", "decoder.", "speaker_encoder.", "encoder."
SPEECH_TOKENIZER = "speech_tokenizer"
DUMMY_CODEC_STD = 0.15
# what a dummy deployment reads of a hub checkpoint: configs and tokenizer files, not weights
CONFIG_FILES = ("*.json", "*.txt", "*.jinja", "tokenizer*", f"{SPEECH_TOKENIZER}/*.json")


def talker_name(name: str) -> str | None:
    """Our name in ``Qwen3TTSTalker`` of a released key (``None``: the speaker encoder's);
    unknown keys pass through unchanged, so ``load_weights`` names them."""
    if name.startswith("speaker_encoder."):
        return None
    return name[len(TALKER):] if name.startswith(TALKER) else name


def codec_name(name: str) -> str | None:
    """Our name in ``Qwen3TTSCodec`` of a speech-tokenizer key (``None``: the encoder's, and
    the quantizer's ``input_proj``, which only encoding uses)."""
    if name.startswith("encoder.") or name.endswith(".input_proj.weight") and ".quantizer." in name:
        return None
    return name[len(CODEC):] if name.startswith(CODEC) else name


def encoder_names(config: EncoderConfig) -> Callable[[str], str | None]:
    """The name map of ``Qwen3TTSCodecEncoder`` from speech-tokenizer keys: ``encoder.`` less
    the prefix; ``None`` for the decoder's keys and for what only Mimi's own decoding uses (the
    quantizers' ``output_proj``, ``initialized`` flags, levels past the kept codebooks)."""
    acoustic = config.valid_quantizers - config.num_semantic_quantizers
    level = re.compile(r"quantizer\.(semantic|acoustic)_residual_vector_quantizer\.layers\.(\d+)\.")

    def name_map(name: str) -> str | None:
        if name.startswith(CODEC):
            return None
        name = name[len(ENCODER):] if name.startswith(ENCODER) else name
        if name.endswith((".initialized", "_residual_vector_quantizer.output_proj.weight")):
            return None
        kept = level.match(name)
        if kept and int(kept[2]) >= (acoustic if kept[1] == "acoustic" else config.num_semantic_quantizers):
            return None
        return name

    return name_map


def speaker_name(name: str) -> str | None:
    """Our name in ``Qwen3TTSSpeakerEncoder`` of a released key (``None``: the talker's)."""
    if name.startswith(TALKER):
        return None
    return name[len(SPEAKER):] if name.startswith(SPEAKER) else name


def load_speaker_encoder(encoder: Qwen3TTSSpeakerEncoder, tensors: Iterable[tuple[str, torch.Tensor]],
                         dtype: torch.dtype | None = None) -> None:
    load_weights(encoder, tensors, name_map=speaker_name, dtype=dtype)


def load_talker(talker: Qwen3TTSTalker, tensors: Iterable[tuple[str, torch.Tensor]],
                dtype: torch.dtype | None = None) -> None:
    load_weights(talker, tensors, name_map=talker_name, dtype=dtype)


def load_codec_encoder(encoder: Qwen3TTSCodecEncoder, tensors: Iterable[tuple[str, torch.Tensor]],
                       dtype: torch.dtype | None = None) -> None:
    load_weights(encoder, tensors, name_map=encoder_names(encoder.config), dtype=dtype)


def load_codec(codec: Qwen3TTSCodec, tensors: Iterable[tuple[str, torch.Tensor]],
               dtype: torch.dtype | None = None) -> None:
    load_weights(codec, tensors, name_map=codec_name, dtype=dtype)


@dataclass(frozen=True)
class Qwen3TTSCheckpoint:
    """A Qwen3-TTS 12 Hz checkpoint directory in the released layout, and its parts built from
    it with the checkpoint's tensors or, for ``load_format: dummy``, seeded random weights."""

    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None, *, dummy: bool = False) -> Qwen3TTSCheckpoint:
        from mstar.model.weights import resolve_model_path

        path = Path(resolve_model_path(model_path, cache_dir=cache_dir,
                                       allow_patterns=CONFIG_FILES if dummy else None))
        for need in ("config.json", f"{SPEECH_TOKENIZER}/config.json"):
            if not (path / need).is_file():
                raise ValueError(f"model_path {path}: no {need} (expected a Qwen3-TTS 12 Hz checkpoint)")
        return cls(path)

    def hf_config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def config(self) -> Qwen3TTSConfig:
        """The talker's config; its ``tts_model_type`` is the variant."""
        return Qwen3TTSConfig.from_hf_dict(self.hf_config())

    def codec_config(self) -> CodecConfig:
        return CodecConfig.from_hf_dict(json.loads((self.path / SPEECH_TOKENIZER / "config.json").read_text()))

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def talker(self, device: torch.device | str, dtype: torch.dtype, *, dummy: bool, seed: int) -> Qwen3TTSTalker:
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            talker = Qwen3TTSTalker(self.config().talker)
        return fill_weights(talker, lambda: iter_safetensors(self.path), dummy=dummy, seed=seed, dtype=dtype,
                            name_map=talker_name)

    def speaker_encoder(self, device: torch.device | str, dtype: torch.dtype, *, dummy: bool,
                        seed: int) -> Qwen3TTSSpeakerEncoder:
        """The base checkpoints' speaker encoder (``speaker_encoder.`` keys of the same file)."""
        config = self.config()
        if not config.clones:
            raise ValueError(f"{self.path}: a {config.tts_model_type} checkpoint has no speaker encoder")
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            encoder = Qwen3TTSSpeakerEncoder(config.speaker_encoder)
        return fill_weights(encoder, lambda: iter_safetensors(self.path), dummy=dummy, seed=seed, dtype=dtype,
                            name_map=speaker_name)

    def codec(self, device: torch.device | str, dtype: torch.dtype, *, dummy: bool, seed: int) -> Qwen3TTSCodec:
        """The codec decoder; dummy weights are drawn wider than a dummy LM's (std 0.15, codebook
        usage 1) so that a dummy deployment's audio is audible, not rounded to silence."""
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            codec = Qwen3TTSCodec(self.codec_config())
        if dummy:
            init_dummy_weights(codec, seed=seed, std=DUMMY_CODEC_STD)
            with torch.no_grad():
                for name, p in codec.named_parameters():
                    if name.endswith("cluster_usage"):
                        p.fill_(1.0)
            return codec.eval()
        return fill_weights(codec, lambda: iter_safetensors(self.path / SPEECH_TOKENIZER), dummy=False, seed=seed,
                            dtype=dtype, name_map=codec_name)

    def codec_encoder_config(self) -> EncoderConfig:
        return EncoderConfig.from_hf_dict(json.loads((self.path / SPEECH_TOKENIZER / "config.json").read_text()))

    def codec_encoder(self, device: torch.device | str, dtype: torch.dtype, *, dummy: bool,
                      seed: int) -> Qwen3TTSCodecEncoder:
        """The codec's encoder (in-context cloning: a clip to its codes). Dummy codebooks are
        drawn (N(0, 1) codewords) so that a dummy deployment's clips get varied codes."""
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            encoder = Qwen3TTSCodecEncoder(self.codec_encoder_config())
        if dummy:
            init_dummy_weights(encoder, seed=seed, std=DUMMY_CODEC_STD)
            gen = torch.Generator(device=encoder.encoder.layers[0].conv.weight.device).manual_seed(seed)
            with torch.no_grad():
                for name, buf in encoder.named_buffers():
                    if name.endswith("embed_sum"):
                        buf.copy_(torch.randn(buf.shape, generator=gen, device=buf.device).to(buf.dtype))
            return encoder.eval()
        return fill_weights(encoder, lambda: iter_safetensors(self.path / SPEECH_TOKENIZER), dummy=False, seed=seed,
                            dtype=dtype, name_map=encoder_names(encoder.config))
