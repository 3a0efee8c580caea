"""The tiny T3 configs of ``record_reference.py``, on our side, and the fixtures' paths."""

from __future__ import annotations

from pathlib import Path

import torch

from mstar.model.chatterbox.config import GPT2Config, PerceiverConfig, T3Config
from mstar.model.llama.config import LlamaConfig

FIXTURES = Path(__file__).parent / "fixtures"
VERSIONS = "chatterbox-tts 0.1.7, transformers 5.2.0, torch 2.13.0+cpu (tests/chatterbox/record_reference.py)"


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=dict(rope_type="llama3", factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192),
    )


def tiny_config(variant: str) -> T3Config:
    common = dict(start_text_token=38, stop_text_token=0, max_text_tokens=30, max_speech_tokens=40,
                  speaker_embed_size=16, speech_cond_prompt_len=6)
    if variant == "turbo":
        gpt2 = GPT2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                          vocab_size=8)
        return T3Config(variant="turbo", backbone=gpt2, text_vocab_size=50, speech_vocab_size=65,
                        start_speech_token=63, stop_speech_token=64, learned_positions=False, perceiver=None,
                        emotion_adv=False, **common)
    multilingual = variant == "multilingual"  # the reference guards a 2454-token vocabulary's decode
    return T3Config(variant=variant, backbone=tiny_llama(), text_vocab_size=2454 if multilingual else 40,
                    speech_vocab_size=70, start_speech_token=61, stop_speech_token=62,
                    perceiver=PerceiverConfig(queries=4, heads=4),
                    alignment_heads=((1, 3), (0, 1), (1, 0)) if multilingual else (), **common)


def fixture(variant: str) -> dict:
    return torch.load(FIXTURES / f"t3_{variant}.pt")
