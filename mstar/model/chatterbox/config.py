"""The dimensions of Chatterbox's T3 (text to speech-token LM), per variant.

The released checkpoints carry no ``config.json``: the reference package builds T3 from
constants in code (``T3Config`` and ``LLAMA_CONFIGS`` of ``chatterbox-tts``), and so do the
``english``, ``multilingual`` and ``turbo`` constructors here. The English and multilingual
models share a 30-layer, 1024-wide Llama ("Llama_520M") and differ only in the text
vocabulary (704 against 2454 graphemes); Turbo swaps the backbone for GPT-2 medium, reads a
GPT-2 BPE vocabulary, and drops the perceiver, the emotion input, the learned text/speech
positions and classifier-free guidance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mstar.model.llama.config import LlamaConfig

Variant = Literal["english", "multilingual", "turbo"]
VARIANTS: tuple[Variant, ...] = ("english", "multilingual", "turbo")


@dataclass(frozen=True)
class GPT2Config:
    """The GPT-2 backbone's hyper-parameters (Hugging Face ``GPT2Config`` names in the
    comments); ``vocab_size`` is the unused token table the released file still carries."""

    hidden_size: int = 1024  # n_embd
    num_hidden_layers: int = 24  # n_layer
    num_attention_heads: int = 16  # n_head
    max_position_embeddings: int = 8196  # n_positions
    layer_norm_epsilon: float = 1e-5
    vocab_size: int = 50276

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class PerceiverConfig:
    """The resampler that turns the prompt's speech-token embeddings into ``queries`` rows."""

    queries: int = 32
    heads: int = 4


def llama_520m() -> LlamaConfig:
    """The English and multilingual backbone (``Llama_520M`` in the reference)."""
    return LlamaConfig(
        vocab_size=8, hidden_size=1024, intermediate_size=4096, num_hidden_layers=30,
        num_attention_heads=16, num_key_value_heads=16, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling=dict(rope_type="llama3", factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192),
    )


@dataclass(frozen=True)
class T3Config:
    """One T3 variant: backbone, vocabularies, special tokens and conditioning parts.

    ``guided`` variants run a classifier-free-guidance pair (the unconditional row has its text
    token embeddings zeroed); ``learned_positions`` adds learned text and speech position
    tables on top of the backbone's own positions (RoPE); ``perceiver`` resamples the prompt
    speech tokens, ``emotion_adv`` projects the exaggeration scalar into one conditioning row.
    """

    variant: Variant
    backbone: LlamaConfig | GPT2Config
    text_vocab_size: int
    speech_vocab_size: int = 8194
    start_text_token: int = 255
    stop_text_token: int = 0
    start_speech_token: int = 6561
    stop_speech_token: int = 6562
    max_text_tokens: int = 2048
    max_speech_tokens: int = 4096
    speaker_embed_size: int = 256
    speech_cond_prompt_len: int = 150
    learned_positions: bool = True
    perceiver: PerceiverConfig | None = field(default_factory=PerceiverConfig)
    emotion_adv: bool = True
    alignment_heads: tuple[tuple[int, int], ...] = ()
    """(layer, head) pairs whose attention guards the stop token (``alignment.py``); empty:
    no guard. The reference guards the multilingual model alone."""

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @property
    def is_gpt2(self) -> bool:
        return isinstance(self.backbone, GPT2Config)

    @property
    def guided(self) -> bool:
        """Whether the variant decodes a conditional / unconditional pair (Turbo does not)."""
        return not self.is_gpt2

    @property
    def text_positions(self) -> int:
        """Rows of the learned text position table (the reference's ``max_text_tokens + 2``)."""
        return self.max_text_tokens + 2

    @property
    def speech_positions(self) -> int:
        """Rows of the learned speech position table (``max_speech_tokens + 4``)."""
        return self.max_speech_tokens + 4

    @classmethod
    def english(cls) -> T3Config:
        return cls(variant="english", backbone=llama_520m(), text_vocab_size=704)

    @classmethod
    def multilingual(cls) -> T3Config:
        return cls(variant="multilingual", backbone=llama_520m(), text_vocab_size=2454,
                   alignment_heads=((12, 15), (13, 11), (9, 2)))

    @classmethod
    def turbo(cls) -> T3Config:
        return cls(variant="turbo", backbone=GPT2Config(), text_vocab_size=50276, speech_vocab_size=6563,
                   speech_cond_prompt_len=375, learned_positions=False, perceiver=None, emotion_adv=False)

    @classmethod
    def for_variant(cls, variant: str) -> T3Config:
        if variant not in VARIANTS:
            raise ValueError(f"unknown chatterbox variant {variant!r}; expected one of {VARIANTS}")
        return getattr(cls, variant)()
