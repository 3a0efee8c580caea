"""Configuration of the FastConformer speech models: the encoder's dimensions and the
transducer head's, read from a Hugging Face ``config.json``.

Two encoder layouts share one component (``encoder.py``): Parakeet's (``parakeet_encoder``:
symmetric convolutions, batch norm in the conv module, full attention) and the cache-aware
streaming encoder of Nemotron ASR (``nemotron_asr_streaming_encoder``: causal convolutions,
layer norm in the conv module, chunked attention with a left context and a lookahead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

ACTIVATIONS = ("silu", "relu", "gelu", "tanh")
ENCODER_TYPES = {"parakeet_encoder": False, "nemotron_asr_streaming_encoder": True}  # model_type -> causal


def _known(cls, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names and v is not None}


@dataclass
class FastConformerConfig:
    """The encoder. ``causal``: the streaming layout (causal subsampling and depthwise
    convolutions, a layer norm in the conv module); ``left_context`` (frames each frame may
    attend back, ``None``: all) and ``default_lookahead`` (frames ahead, chunked as the
    streaming model was trained: ``None``: full attention)."""

    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 8
    intermediate_size: int = 4096
    hidden_act: str = "silu"
    attention_bias: bool = True
    convolution_bias: bool = True
    conv_kernel_size: int = 9
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    num_mel_bins: int = 80
    subsampling_conv_kernel_size: int = 3
    subsampling_conv_stride: int = 2
    scale_input: bool = True
    causal: bool = False
    left_context: int | None = None
    default_lookahead: int | None = None

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise NotImplementedError(f"unsupported encoder activation {self.hidden_act!r}")
        if self.subsampling_factor < 1 or 2 ** self.num_subsampling_layers != self.subsampling_factor:
            raise NotImplementedError(f"subsampling_factor {self.subsampling_factor} is not a power of 2")
        if self.subsampling_conv_stride != 2:
            raise NotImplementedError("only stride-2 subsampling convolutions are supported")

    @property
    def num_subsampling_layers(self) -> int:
        return int(round(math.log2(self.subsampling_factor)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def _conv_length(self, length: int) -> int:
        k, s = self.subsampling_conv_kernel_size, self.subsampling_conv_stride
        pad = (k - 1) + (s - 1) if self.causal else (k - 1) // 2 * 2
        return (length + pad - k) // s + 1

    def frames(self, mel_frames: int) -> int:
        """Encoder frames of ``mel_frames`` log-mel frames."""
        for _ in range(self.num_subsampling_layers):
            mel_frames = self._conv_length(mel_frames)
        return mel_frames

    @property
    def subsampled_mel_bins(self) -> int:
        """Mel bins left after the subsampling stack (its linear projection reads
        ``channels * subsampled_mel_bins`` features per frame)."""
        return self.frames(self.num_mel_bins)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> FastConformerConfig:
        model_type = d.get("model_type", "parakeet_encoder")
        if model_type not in ENCODER_TYPES:
            raise NotImplementedError(f"unsupported encoder model_type {model_type!r} "
                                      f"(known: {', '.join(ENCODER_TYPES)})")
        kwargs = _known(cls, d)
        kwargs["causal"] = ENCODER_TYPES[model_type]
        if kwargs["causal"]:
            kwargs["left_context"] = int(d.get("sliding_window", 71)) - 1
            kwargs["default_lookahead"] = int(d.get("default_num_lookahead_tokens", 13))
        return cls(**kwargs)

    @classmethod
    def from_nemo(cls, d: dict[str, Any], *, key: str = "encoder") -> FastConformerConfig:
        """From a NeMo ``ConformerEncoder`` section (Canary-Qwen's ``perception.encoder`` and
        ``perception.modality_adapter``): full attention, symmetric convolutions, per-layer
        position biases. A section NeMo would build partly causal, chunked or otherwise
        differently is refused naming ``key`` and the setting. ``subsampling_factor`` 1 (the
        modality adapter): a linear projection of each frame instead of the convolutions."""
        target = str(d.get("_target_", "ConformerEncoder"))
        if not target.endswith("ConformerEncoder"):
            raise NotImplementedError(f"{key}: unsupported module {target!r} (expected a ConformerEncoder)")
        refused = {"causal_downsampling": (False, None), "self_attention_model": ("rel_pos", None),
                   "untie_biases": (True, None), "att_context_style": ("regular", "chunked_limited", None),
                   "conv_norm_type": ("batch_norm", None), "reduction": (None,), "global_tokens": (0, None)}
        for name, allowed in refused.items():
            if d.get(name) not in allowed:
                raise NotImplementedError(f"{key}.{name}: {d.get(name)!r} is not supported here")
        if list(d.get("att_context_size") or [-1, -1]) != [-1, -1]:
            raise NotImplementedError(f"{key}.att_context_size: {d['att_context_size']!r} (only full attention, "
                                      "[-1, -1], is supported)")
        kernel = int(d.get("conv_kernel_size", 31))
        if d.get("conv_context_size") not in (None, [(kernel - 1) // 2, (kernel - 1) // 2]):
            raise NotImplementedError(f"{key}.conv_context_size: {d['conv_context_size']!r} (only symmetric "
                                      "convolutions are supported)")
        if int(d.get("feat_out", -1)) not in (-1, int(d.get("d_model", 256))):
            raise NotImplementedError(f"{key}.feat_out: an output projection is not supported")
        factor = int(d.get("subsampling_factor", 4))
        if factor > 1 and d.get("subsampling", "striding") != "dw_striding":
            raise NotImplementedError(f"{key}.subsampling: {d.get('subsampling')!r} (only dw_striding)")
        width = int(d.get("d_model", 256))
        channels = int(d.get("subsampling_conv_channels", -1))
        use_bias = bool(d.get("use_bias", True))
        return cls(hidden_size=width, num_hidden_layers=int(d.get("n_layers", 1)),
                   num_attention_heads=int(d.get("n_heads", 4)),
                   intermediate_size=width * int(d.get("ff_expansion_factor", 4)), attention_bias=use_bias,
                   convolution_bias=use_bias, conv_kernel_size=kernel, subsampling_factor=factor,
                   subsampling_conv_channels=width if channels == -1 else channels,
                   num_mel_bins=int(d.get("feat_in", 128)), scale_input=bool(d.get("xscaling", True)))


@dataclass
class TransducerConfig:
    """An encoder with a transducer head: the LSTM prediction network, the joint network
    and, for TDT (``durations`` not empty), the duration outputs after the vocabulary.
    ``num_prompts`` > 0: the encoder output is fused with a one-hot language prompt
    (Nemotron ASR)."""

    model_type: str
    encoder: FastConformerConfig
    vocab_size: int
    blank_token_id: int
    decoder_hidden_size: int = 640
    num_decoder_layers: int = 2
    hidden_act: str = "relu"
    max_symbols_per_step: int = 10
    durations: tuple[int, ...] = ()
    num_prompts: int = 0
    prompt_intermediate_size: int = 0
    default_prompt_id: int = 0
    decoder_start_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise NotImplementedError(f"unsupported joint activation {self.hidden_act!r}")
        if not 0 <= self.blank_token_id < self.vocab_size:
            raise ValueError(f"blank_token_id {self.blank_token_id} is outside the vocabulary ({self.vocab_size})")
        if self.max_symbols_per_step < 1:
            raise ValueError("max_symbols_per_step must be >= 1")
        self.durations = tuple(int(d) for d in self.durations)
        if self.decoder_start_token_id is None:
            self.decoder_start_token_id = self.blank_token_id

    @property
    def is_tdt(self) -> bool:
        return bool(self.durations)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], generation: dict[str, Any] | None = None) -> TransducerConfig:
        """From a ``parakeet_tdt``, ``parakeet_rnnt`` or ``nemotron3_5_asr`` ``config.json``
        (and its ``generation_config.json``, for the decoder's start token)."""
        model_type = d.get("model_type")
        if model_type not in ("parakeet_tdt", "parakeet_rnnt", "nemotron3_5_asr"):
            raise NotImplementedError(f"unsupported transducer model_type {model_type!r}")
        encoder = dict(d.get("encoder_config") or {})
        kwargs = {k: v for k, v in _known(cls, d).items() if k not in ("model_type", "encoder", "extra")}
        if model_type == "nemotron3_5_asr":
            encoder.setdefault("model_type", "nemotron_asr_streaming_encoder")
            kwargs = {"num_prompts": 128, "prompt_intermediate_size": 2048, "default_prompt_id": 101} | kwargs
        if model_type == "parakeet_tdt":
            kwargs.setdefault("durations", (0, 1, 2, 3, 4))
        start = (generation or {}).get("decoder_start_token_id")
        if start is not None:
            kwargs["decoder_start_token_id"] = int(start)
        return cls(model_type=model_type, encoder=FastConformerConfig.from_hf_dict(encoder), **kwargs)
