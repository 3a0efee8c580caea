"""The shape of a Piper voice: VITS hyperparameters plus what Piper's JSON adds.

Piper's ONNX file carries no hyperparameters of its own, so ``PiperArch`` is read back from
the initializer shapes and the convolution attributes of the exported graph (``onnx_weights``).
The JSON next to it (``<voice>.onnx.json``) gives the sample rate, the phoneme-id map, the
espeak voice, the speakers and the default inference scales (``PiperVoiceConfig``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PiperArch", "PiperVoiceConfig"]


@dataclass(frozen=True)
class PiperArch:
    """VITS inference hyperparameters (the names follow the VITS paper's code)."""

    n_vocab: int = 256
    hidden: int = 192
    filter_channels: int = 768
    n_heads: int = 2
    n_layers: int = 6
    kernel_size: int = 3
    window_size: int = 4
    inter_channels: int = 192
    dp_filter_channels: int = 192
    dp_kernel_size: int = 3
    dp_n_flows: int = 4
    dp_num_bins: int = 10
    dp_tail_bound: float = 5.0
    flow_n_couplings: int = 4
    flow_kernel_size: int = 5
    flow_n_layers: int = 4
    flow_dilation_rate: int = 1
    resblock: str = "2"
    resblock_kernel_sizes: tuple[int, ...] = (3, 5, 7)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 2), (2, 6), (3, 12))
    upsample_rates: tuple[int, ...] = (8, 8, 4)
    upsample_initial_channel: int = 256
    upsample_kernel_sizes: tuple[int, ...] = (16, 16, 8)
    n_speakers: int = 1
    gin_channels: int = 0

    @property
    def hop_length(self) -> int:
        """Audio samples per latent frame (the decoder's total upsampling)."""
        out = 1
        for rate in self.upsample_rates:
            out *= rate
        return out


@dataclass(frozen=True)
class PiperVoiceConfig:
    """What a Piper voice's ``.onnx.json`` says about using the network."""

    sample_rate: int
    espeak_voice: str
    phoneme_type: str
    phoneme_id_map: dict[str, list[int]]
    noise_scale: float = 0.667
    length_scale: float = 1.0
    noise_w: float = 0.8
    num_speakers: int = 1
    num_symbols: int = 256
    speaker_id_map: dict[str, int] = field(default_factory=dict)
    name: str = "piper"
    language: str | None = None  # BCP 47 (the JSON's ``language.code``, ``en_US`` -> ``en-US``)

    @classmethod
    def from_json(cls, path: str | Path) -> PiperVoiceConfig:
        """Read a Piper voice JSON; the voice name is the dataset (or the file's stem)."""
        raw: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
        inference = raw.get("inference", {})
        stem = Path(path).name.removesuffix(".json").removesuffix(".onnx")
        return cls(
            sample_rate=int(raw["audio"]["sample_rate"]),
            espeak_voice=str(raw.get("espeak", {}).get("voice", "en-us")),
            phoneme_type=str(raw.get("phoneme_type", "espeak")),
            phoneme_id_map={str(k): [int(i) for i in v] for k, v in raw["phoneme_id_map"].items()},
            noise_scale=float(inference.get("noise_scale", 0.667)),
            length_scale=float(inference.get("length_scale", 1.0)),
            noise_w=float(inference.get("noise_w", 0.8)),
            num_speakers=int(raw.get("num_speakers", 1)),
            num_symbols=int(raw.get("num_symbols", 256)),
            speaker_id_map={str(k): int(v) for k, v in raw.get("speaker_id_map", {}).items()},
            name=str(raw.get("dataset") or stem),
            language=(raw.get("language") or {}).get("code", "").replace("_", "-") or None,
        )
