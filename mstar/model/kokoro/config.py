"""Kokoro's architecture, read from the checkpoint's ``config.json`` (hexgrad/Kokoro-82M).

Field names are the ``config.json`` keys, so ``KModel(config=cfg.to_dict())`` builds the
reference. Keys the released file carries but nothing reads (``dim_in``, ``max_conv_dim``,
``multispeaker``) are accepted and ignored, as the reference ignores them; any other unknown
key is an error naming it. Defaults are Kokoro-82M's shapes (the vocabulary aside, which always
comes from the file).

Two widths are fixed by the architecture rather than the file: the decoder's residual trunk
(1024 channels, then 512 into the generator, plus a 64-channel skip of the text features), and
the voice vector, ``2 * style_dim`` wide: its first half styles the decoder, its second half the
prosody predictor.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mstar.model.vocoder import ISTFTNetConfig

__all__ = ["DECODER_OUT_CHANNELS", "KokoroConfig", "PLBertConfig"]

DECODER_OUT_CHANNELS = 512
"""Channels of the decoder trunk's last block: the generator's ``upsample_initial_channel``."""

_IGNORED_KEYS = frozenset({"dim_in", "max_conv_dim", "multispeaker"})


def _known(cls: type, d: dict[str, Any], where: str, ignored: frozenset[str] = frozenset()) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names - ignored)
    if unknown:
        raise ValueError(f"unknown Kokoro config keys in {where}: {unknown} (known: {sorted(names)})")
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True)
class PLBertConfig:
    """The ALBERT phoneme encoder (``plbert`` in ``config.json``); unset keys take
    ``transformers.AlbertConfig``'s defaults, as the reference builds it from them."""

    hidden_size: int = 768
    num_attention_heads: int = 12
    intermediate_size: int = 2048
    max_position_embeddings: int = 512
    num_hidden_layers: int = 12
    dropout: float = 0.1  # read by nothing (inference), kept for the round trip
    embedding_size: int = 128
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2
    num_hidden_groups: int = 1
    inner_group_num: int = 1
    hidden_act: str = "gelu_new"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("plbert.hidden_size must be divisible by plbert.num_attention_heads")
        if self.num_hidden_groups != 1 or self.inner_group_num != 1:
            raise ValueError("plbert: only one shared layer group of one layer is supported (as in Kokoro)")
        if self.hidden_act not in {"gelu_new", "gelu"}:
            raise ValueError(f"plbert.hidden_act {self.hidden_act!r} is not supported (gelu_new, gelu)")


def _default_istftnet() -> dict[str, Any]:
    return {
        "upsample_kernel_sizes": [20, 12],
        "upsample_rates": [10, 6],
        "gen_istft_hop_size": 5,
        "gen_istft_n_fft": 20,
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        "resblock_kernel_sizes": [3, 7, 11],
        "upsample_initial_channel": DECODER_OUT_CHANNELS,
    }


@dataclass(frozen=True)
class KokoroConfig:
    vocab: dict[str, int] = field(default_factory=dict)
    n_token: int = 178
    hidden_dim: int = 512
    style_dim: int = 128
    n_layer: int = 3
    max_dur: int = 50
    dropout: float = 0.2
    text_encoder_kernel_size: int = 5
    n_mels: int = 80
    plbert: PLBertConfig = field(default_factory=PLBertConfig)
    istftnet: dict[str, Any] = field(default_factory=_default_istftnet)

    def __post_init__(self) -> None:
        if isinstance(self.plbert, dict):
            object.__setattr__(self, "plbert", PLBertConfig(**_known(PLBertConfig, self.plbert, "plbert")))
        bad = {p: i for p, i in self.vocab.items() if not 0 < i < self.n_token}
        if bad:
            raise ValueError(f"vocab ids must lie in [1, n_token={self.n_token}): {bad}")
        if self.istftnet.get("upsample_initial_channel") != DECODER_OUT_CHANNELS:
            raise ValueError(
                f"istftnet.upsample_initial_channel must be {DECODER_OUT_CHANNELS} (the decoder trunk's width)"
            )
        self.generator_config()  # validates the istftnet block

    def generator_config(self) -> ISTFTNetConfig:
        known = {f.name for f in fields(ISTFTNetConfig)} - {"style_dim"}
        unknown = sorted(set(self.istftnet) - known)
        if unknown:
            raise ValueError(f"unknown Kokoro config keys in istftnet: {unknown}")
        g = self.istftnet
        return ISTFTNetConfig(
            style_dim=self.style_dim,
            upsample_rates=tuple(g["upsample_rates"]),
            upsample_kernel_sizes=tuple(g["upsample_kernel_sizes"]),
            upsample_initial_channel=g["upsample_initial_channel"],
            resblock_kernel_sizes=tuple(g["resblock_kernel_sizes"]),
            resblock_dilation_sizes=tuple(tuple(d) for d in g["resblock_dilation_sizes"]),
            gen_istft_n_fft=g["gen_istft_n_fft"],
            gen_istft_hop_size=g["gen_istft_hop_size"],
        )

    @property
    def voice_dim(self) -> int:
        """Width of a voice (style) vector: decoder half, then prosody half."""
        return 2 * self.style_dim

    @property
    def max_input_tokens(self) -> int:
        """Token ids one forward takes, the two boundary pads included (the PL-BERT window)."""
        return self.plbert.max_position_embeddings

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per predicted duration frame (the decoder doubles the frame rate)."""
        return 2 * self.generator_config().samples_per_frame

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KokoroConfig:
        return cls(**_known(cls, d, "config.json", _IGNORED_KEYS))

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> KokoroConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict (what ``kokoro.KModel(config=...)`` takes)."""
        d = asdict(self)
        defaults = asdict(PLBertConfig())
        d["plbert"] = {k: v for k, v in d["plbert"].items() if k in _PLBERT_FILE_KEYS or v != defaults[k]}
        return d


_PLBERT_FILE_KEYS = frozenset(
    {"hidden_size", "num_attention_heads", "intermediate_size", "max_position_embeddings", "num_hidden_layers",
     "dropout"}
)
