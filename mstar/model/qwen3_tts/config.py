"""Configuration of the Qwen3-TTS 12 Hz checkpoints (``config.json`` of the talker and the
speech tokenizer's ``config.json``).

One config serves every 12 Hz checkpoint; the variant is read from it (``tts_model_type``:
``custom_voice`` has built-in speakers, ``voice_design`` takes the voice as an instruction,
``base`` clones from a reference clip through its speaker encoder). Defaults follow the
reference's config classes (``qwen-tts==0.1.1``) so that a key left out means the same here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar.model.hf_config import config_kwargs
from mstar.model.llama.config import LlamaConfig

VARIANTS = ("custom_voice", "voice_design", "base")


def _kwargs(cls, d: dict[str, Any], nullable: set[str]) -> dict[str, Any]:
    kwargs = config_kwargs(cls, d, nullable)
    kwargs.pop("rope_scaling", None)  # checked by ``_plain_rope``
    return kwargs


def _plain_rope(d: dict[str, Any], where: str) -> None:
    """Refuse rope scalings other than the default: the talker's MRoPE sections all see the
    same text position, which makes it the plain RoPE."""
    rope = d.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise NotImplementedError(f"{where}.rope_scaling rope_type {kind!r} is not supported")


@dataclass
class DecoderDims:
    """A dense Qwen3 decoder's dimensions (the talker's and the code predictor's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} is not supported")

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           max_position_embeddings=self.max_position_embeddings,
                           attention_bias=self.attention_bias, hidden_act=self.hidden_act)


PREDICTOR_DEFAULTS = dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128)
TALKER_DEFAULTS = dict(vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=20,
                       num_attention_heads=16, num_key_value_heads=2)


def decoder_dims(d: dict[str, Any], defaults: dict[str, Any], where: str) -> DecoderDims:
    _plain_rope(d, where)
    return DecoderDims(**_kwargs(DecoderDims, {**defaults, **d}, nullable={"head_dim"}))


@dataclass
class TalkerConfig:
    """The talker (``talker_config``): its decoder, the code predictor and the codec's ids."""

    text: DecoderDims
    predictor: DecoderDims
    num_code_groups: int = 32
    text_hidden_size: int = 2048
    text_vocab_size: int = 151936
    codec_eos_token_id: int = 4198
    codec_pad_id: int = 4196
    codec_bos_id: int = 4197
    codec_think_id: int = 4202
    codec_nothink_id: int = 4203
    codec_think_bos_id: int = 4204
    codec_think_eos_id: int = 4205
    spk_id: dict[str, int] = field(default_factory=dict)
    spk_is_dialect: dict[str, Any] = field(default_factory=dict)
    codec_language_id: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_code_groups < 2:
            raise ValueError(f"num_code_groups {self.num_code_groups}: the code predictor needs at least 2")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> TalkerConfig:
        """From a ``talker_config`` dict (unknown keys ignored)."""
        predictor = dict(d.get("code_predictor_config") or {})
        groups = d.get("num_code_groups", 32)
        if predictor.get("num_code_groups", groups) != groups:
            raise ValueError(f"talker_config.num_code_groups {groups} != code_predictor_config.num_code_groups "
                             f"{predictor['num_code_groups']}")
        names = {"num_code_groups", "text_hidden_size", "text_vocab_size", "codec_eos_token_id", "codec_pad_id",
                 "codec_bos_id", "codec_think_id", "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id",
                 "spk_id", "spk_is_dialect", "codec_language_id"}
        kwargs = {k: d[k] for k in names if d.get(k) is not None}
        return cls(text=decoder_dims(d, TALKER_DEFAULTS, "talker_config"),
                   predictor=decoder_dims(predictor, PREDICTOR_DEFAULTS, "talker_config.code_predictor_config"),
                   **kwargs)


@dataclass
class SpeakerEncoderConfig:
    """The ECAPA-TDNN speaker encoder of the base (cloning) checkpoints."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: list[int] = field(default_factory=lambda: [512, 512, 512, 512, 1536])
    enc_kernel_sizes: list[int] = field(default_factory=lambda: [5, 3, 3, 3, 1])
    enc_dilations: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 1])
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> SpeakerEncoderConfig:
        return cls(**_kwargs(cls, d, nullable=set()))


@dataclass
class Qwen3TTSConfig:
    """A whole Qwen3-TTS ``config.json``: the talker, the speaker encoder and the text ids."""

    talker: TalkerConfig
    speaker_encoder: SpeakerEncoderConfig
    tts_model_type: str = "custom_voice"
    tts_model_size: str | None = None
    tokenizer_type: str | None = None
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673

    def __post_init__(self) -> None:
        if self.tts_model_type not in VARIANTS:
            raise ValueError(f"tts_model_type {self.tts_model_type!r}: expected one of {', '.join(VARIANTS)}")
        if self.tokenizer_type not in (None, "qwen3_tts_tokenizer_12hz"):
            raise NotImplementedError(f"tokenizer_type {self.tokenizer_type!r}: only the 12 Hz tokenizer is served")

    @property
    def speakers(self) -> list[str]:
        """The built-in speakers (empty but for ``custom_voice``)."""
        return sorted(self.talker.spk_id) if self.tts_model_type == "custom_voice" else []

    @property
    def clones(self) -> bool:
        """Whether requests clone a voice from a reference clip (the base checkpoints)."""
        return self.tts_model_type == "base"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3TTSConfig:
        names = {"tts_model_type", "tts_model_size", "tokenizer_type", "im_start_token_id", "im_end_token_id",
                 "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id"}
        kwargs = {k: d[k] for k in names if d.get(k) is not None}
        return cls(talker=TalkerConfig.from_hf_dict(d.get("talker_config") or {}),
                   speaker_encoder=SpeakerEncoderConfig.from_hf_dict(d.get("speaker_encoder_config") or {}),
                   **kwargs)


@dataclass
class CodecConfig:
    """The 12 Hz speech tokenizer's decoder (``decoder_config`` of its ``config.json``)."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    hidden_size: int = 1024
    latent_dim: int = 1024
    max_position_embeddings: int = 8000
    rope_theta: float = 10000.0
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    attention_bias: bool = False
    sliding_window: int = 72
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: list[int] = field(default_factory=lambda: [8, 5, 4, 3])
    upsampling_ratios: list[int] = field(default_factory=lambda: [2, 2])
    decoder_dim: int = 1536
    output_sample_rate: int = 24000

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_quantizers < 2:
            raise ValueError("num_quantizers must be at least 2 (one semantic, the rest acoustic)")

    @property
    def samples_per_frame(self) -> int:
        """Output samples per codec frame (1920 for the released 12.5 Hz decoder at 24 kHz)."""
        n = 1
        for r in [*self.upsampling_ratios, *self.upsample_rates]:
            n *= r
        return n

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> CodecConfig:
        """From the tokenizer's whole ``config.json`` (``decoder_config``) or the decoder part."""
        rate = d.get("output_sample_rate")
        d = dict(d.get("decoder_config", d))
        _plain_rope(d, "decoder_config")
        if rate is not None:
            d["output_sample_rate"] = rate
        return cls(**_kwargs(cls, d, nullable={"head_dim"}))
