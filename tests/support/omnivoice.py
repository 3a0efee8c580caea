"""A tiny OmniVoice release for tests: ``config.json``, ``audio_tokenizer/config.json`` and a
character ``tokenizer.json`` with OmniVoice's control tokens (weights: ``load_format: dummy``
or written by the test)."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<|denoise|>", "<|lang_start|>", "<|lang_end|>", "<|instruct_start|>", "<|instruct_end|>",
                  "<|text_start|>", "<|text_end|>")


def char_tokenizer(extra: str = "你好世界。，한국어こんにちはการ"):
    """A ``tokenizers.Tokenizer`` of one id per character (ASCII and ``extra``; others are
    ``<unk>``) with OmniVoice's control tokens, under 1100 ids (the tiny LLM's vocabulary)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    chars = [chr(i) for i in range(32, 127)] + sorted(set(extra))
    vocab = {"<unk>": 0, **{ch: i + 1 for i, ch in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def write_tiny_release(directory: Path) -> Path:
    """The configs of ``mstar.model.omnivoice.tiny_config()`` and the tokenizer, in the
    release's layout (no weights)."""
    from mstar.model.omnivoice import tiny_config

    config = tiny_config()
    codec = config.codec
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "omnivoice", "audio_vocab_size": config.audio_vocab_size,
        "audio_mask_id": config.audio_mask_id, "num_audio_codebook": config.num_audio_codebook,
        "llm_config": config.llm.to_hf_dict()}))
    (directory / "audio_tokenizer").mkdir(exist_ok=True)
    (directory / "audio_tokenizer" / "config.json").write_text(json.dumps({
        "model_type": "higgs_audio_v2_tokenizer", "sample_rate": codec.sample_rate,
        "codebook_size": codec.codebook_size, "codebook_dim": codec.codebook_dim,
        "target_bandwidths": list(codec.target_bandwidths), "semantic_sample_rate": codec.semantic_sample_rate,
        "downsample_factor": codec.downsample_factor,
        "acoustic_model_config": {"model_type": "dac", "encoder_hidden_size": codec.encoder_hidden_size,
                                  "hidden_size": codec.acoustic_hidden_size,
                                  "decoder_hidden_size": codec.decoder_hidden_size,
                                  "upsampling_ratios": list(codec.upsampling_ratios),
                                  "downsampling_ratios": list(codec.downsampling_ratios)},
        "semantic_model_config": dict(codec.semantic)}))
    char_tokenizer().save(str(directory / "tokenizer.json"))
    return directory
