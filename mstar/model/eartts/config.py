"""EarTTS's configuration, read from the released NemotronVoiceChat layout.

The VoiceChat ``config.json`` keeps the talker under ``model.speech_generation``: its
``model.tts_config`` (the Gemma-3 backbone's ``backbone_config``, the MoG head's
``mog_head_config``, the RVQ sizes) and ``model.codec_config`` (the causal RVQ codec), with
the inference knobs (``inference_guidance_scale``, ``inference_top_p_or_k``,
``inference_noise_scale``) beside them and the frame and sample rates under ``data``.
``from_speech_generation`` takes that ``speech_generation`` dict (or the whole config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CodecConfig:
    """The causal RVQ codec (``RVQVAEModel``): codes ``[T, num_quantizers]`` -> 22.05 kHz PCM,
    ``wav_to_token_ratio`` samples per frame (80 ms)."""

    latent_size: int = 512
    n_fft: int = 16
    hop_length: int = 4
    base_hidden_size: int = 384
    channel_mult: tuple[int, ...] = (1, 2, 4)  # the encoder's; the decoder runs them reversed
    rates: tuple[int, ...] = (7, 7, 9)
    num_blocks: int = 3
    kernel_size: int = 7
    groups: int = 1
    codebook_size: int = 1024
    num_quantizers: int = 31
    wav_to_token_ratio: int = 1764
    sample_rate: int = 22050

    def __post_init__(self) -> None:
        upsample = self.hop_length
        for rate in self.rates:
            upsample *= rate
        if upsample != self.wav_to_token_ratio:
            raise ValueError(f"codec_config: hop_length x rates = {upsample}, not wav_to_token_ratio "
                             f"({self.wav_to_token_ratio})")
        if (self.n_fft - self.hop_length) % 2:
            raise ValueError("codec_config: n_fft - hop_length must be even")

    @property
    def decoder_channels(self) -> list[int]:
        """Each decoder stage's width (the stages upsample by ``reversed(rates)``)."""
        return [self.base_hidden_size * mult for mult in reversed(self.channel_mult)]

    @property
    def overlap(self) -> int:
        """Samples of the inverse STFT's overlap-add a frame leaves pending for the next."""
        return self.n_fft - self.hop_length

    @classmethod
    def from_dict(cls, raw: dict[str, Any], sample_rate: int = 22050) -> CodecConfig:
        keys = {f for f in cls.__dataclass_fields__ if f != "sample_rate"}
        values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in keys}
        return cls(**values, sample_rate=sample_rate)


@dataclass(frozen=True)
class TalkerConfig:
    """The EarTTS talker (``RVQEARTTSModel``): a Gemma-3 text backbone over fused code and text
    embeddings, and a mixture-of-Gaussians head unmasked over ``num_iter`` iterations."""

    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = 4096
    layer_types: tuple[str, ...] = ()
    rope_theta: float = 1_000_000.0  # full-attention layers
    rope_local_theta: float = 10_000.0  # sliding-window layers
    latent_size: int = 512
    codebook_size: int = 1024
    num_quantizers: int = 31
    exponent: float = 3.0
    mog_intermediate_size: int = 4608
    mog_num_layers: int = 3
    mog_low_rank: int | None = 64
    mog_num_predictions: int = 1024
    mog_min_log_std: float = -4.0
    mog_eps: float = 1e-6
    use_gated_fusion: bool = True
    use_audio_prompt_projection: bool = False
    # Inference defaults (DuplexEARTTS._get_generation_config).
    num_iter: int = 8
    guidance_scale: float = 0.5
    top_p: float | int = 0.8
    noise_scale: float = 0.8
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.layer_types:
            pattern = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                            for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", pattern)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"tts_config.backbone_config.layer_types: {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        if self.head_dim % 2:
            raise ValueError("tts_config.backbone_config.head_dim must be even (RoPE)")
        if self.mog_low_rank is not None:
            for name, size in (("mog_head_config.low_rank", self.mog_low_rank), ("latent_size", self.latent_size)):
                if size & (size - 1):
                    raise ValueError(f"tts_config.{name} ({size}) must be a power of two with a low-rank MoG head")

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def theta(self, layer: int) -> float:
        return self.rope_local_theta if self.layer_types[layer] == "sliding_attention" else self.rope_theta

    @classmethod
    def from_tts_config(cls, tts: dict[str, Any], model: dict[str, Any] | None = None) -> TalkerConfig:
        """From ``tts_config`` (and the ``speech_generation.model`` dict's inference knobs)."""
        if tts.get("backbone_type", "gemma3_text") != "gemma3_text":
            raise ValueError(f"tts_config.backbone_type {tts.get('backbone_type')!r}: only gemma3_text is ported")
        if tts.get("context_hidden_size") is not None:
            raise ValueError("tts_config.context_hidden_size: the LLM-context conditioning is not ported")
        if tts.get("random_target_masking"):
            raise ValueError("tts_config.random_target_masking is not ported")
        if not tts.get("disable_eos_prediction", False):
            raise ValueError("tts_config.disable_eos_prediction: false (an EOS head) is not ported")
        backbone = dict(tts.get("backbone_config") or {})
        mog = dict(tts.get("mog_head_config") or {})
        model = model or {}
        rope = backbone.get("rope_parameters") or {}
        values: dict[str, Any] = {
            "hidden_size": backbone.get("hidden_size", 1152),
            "intermediate_size": backbone.get("intermediate_size", 4608),
            "num_hidden_layers": backbone.get("num_hidden_layers", 28),
            "num_attention_heads": backbone.get("num_attention_heads", 16),
            "num_key_value_heads": backbone.get("num_key_value_heads", 16),
            "head_dim": backbone.get("head_dim", 72),
            "rms_norm_eps": backbone.get("rms_norm_eps", 1e-6),
            "query_pre_attn_scalar": float(backbone.get("query_pre_attn_scalar", 256)),
            "sliding_window": backbone.get("sliding_window", 4096),
            "layer_types": tuple(backbone.get("layer_types") or ()),
            "rope_theta": float(rope.get("full_attention", {}).get("rope_theta", backbone.get("rope_theta", 1e6))),
            "rope_local_theta": float(rope.get("sliding_attention", {}).get(
                "rope_theta", backbone.get("rope_local_base_freq", 1e4))),
            "latent_size": tts.get("latent_size", 512),
            "codebook_size": tts.get("codebook_size", 1024),
            "num_quantizers": tts.get("num_quantizers", 31),
            "exponent": float(tts.get("exponent", 3.0)),
            "mog_intermediate_size": mog.get("intermediate_size", 4608),
            "mog_num_layers": mog.get("num_layers", 3),
            "mog_low_rank": mog.get("low_rank", 64),
            "mog_num_predictions": mog.get("num_predictions", 1024),
            "mog_min_log_std": float(mog.get("min_log_std", -4.0)),
            "mog_eps": float(mog.get("eps", 1e-6)),
            "use_gated_fusion": bool(tts.get("use_gated_fusion_for_text_audio", False)),
            "use_audio_prompt_projection": bool(tts.get("use_audio_prompt_frozen_projection", False)),
            "guidance_scale": float(model.get("inference_guidance_scale", 0.5)),
            "top_p": model.get("inference_top_p_or_k", 0.8),  # a float: top-p; an int: top-k
            "noise_scale": float(model.get("inference_noise_scale", 0.8)),
        }
        if backbone.get("attn_logit_softcapping") is not None:
            raise ValueError("tts_config.backbone_config.attn_logit_softcapping is not ported")
        return cls(**values, extra={"cas_config": tts.get("cas_config")})


@dataclass(frozen=True)
class EarTTSConfig:
    talker: TalkerConfig
    codec: CodecConfig
    frame_length: float = 0.08
    audio_prompt_duration: float = 3.0

    @classmethod
    def from_speech_generation(cls, raw: dict[str, Any]) -> EarTTSConfig:
        """From the VoiceChat config's ``model.speech_generation`` (or the whole config)."""
        if "speech_generation" in raw.get("model", {}):
            raw = raw["model"]["speech_generation"]
        model, data = raw["model"], raw.get("data", {})
        sample_rate = int(data.get("target_sample_rate", 22050))
        codec = CodecConfig.from_dict(model["codec_config"], sample_rate=sample_rate)
        talker = TalkerConfig.from_tts_config(model["tts_config"], model)
        if (talker.latent_size, talker.codebook_size, talker.num_quantizers) != (
                codec.latent_size, codec.codebook_size, codec.num_quantizers):
            raise ValueError("tts_config and codec_config disagree on latent_size/codebook_size/num_quantizers")
        return cls(talker, codec, float(data.get("frame_length", 0.08)),
                   float(data.get("audio_prompt_duration", 3.0)))
