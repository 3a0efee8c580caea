"""A tiny random Qwen3-ASR for tests: transformers' ``Qwen3ASRForConditionalGeneration`` as
the reference, written to disk in transformers' layout or in the released one
(``thinker.*``, the projector as ``audio_tower.proj1`` / ``proj2``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

AUDIO_TOKEN = 90
MEL_BINS = 16
AUDIO = {"num_mel_bins": MEL_BINS, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 32,
         "d_model": 16, "output_dim": 32, "n_window": 50, "n_window_infer": 200, "downsample_hidden_size": 8}
TEXT = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def reference(seed: int = 0, spread: float | None = None):
    """The transformers model, seeded, float32, eval mode; ``spread``: every matrix drawn again
    from N(0, spread), so that a greedy decode does not just repeat the prompt's last token."""
    from transformers import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    config = Qwen3ASRConfig(audio_config=dict(AUDIO), text_config=dict(TEXT), audio_token_id=AUDIO_TOKEN,
                            pad_token_id=0, eos_token_id=[1, 2])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "ln_post.weight", "layer_norm.weight")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
            elif spread is not None and p.dim() >= 2:
                p.normal_(0, spread)
    return model


def released_name(name: str) -> str:
    """A transformers tensor name as the released checkpoint spells it."""
    for ours, theirs in (("model.multi_modal_projector.linear_1.", "thinker.audio_tower.proj1."),
                         ("model.multi_modal_projector.linear_2.", "thinker.audio_tower.proj2."),
                         ("model.audio_tower.", "thinker.audio_tower."),
                         ("model.language_model.", "thinker.model."), ("lm_head.", "thinker.lm_head.")):
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise AssertionError(name)


def write_transformers(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def write_released(model, directory: Path, extra: dict[str, torch.Tensor] | None = None,
                   drop: str | None = None) -> Path:
    """The released layout: ``config.json`` under ``thinker_config``, ``thinker.*`` tensors (the
    tied ``lm_head`` included, as the release keeps it)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3ASRForConditionalGeneration"], "model_type": "qwen3_asr",
              "thinker_config": {"audio_config": dict(AUDIO), "text_config": dict(TEXT),
                                 "audio_token_id": AUDIO_TOKEN}}
    (directory / "config.json").write_text(json.dumps(config))
    state = {released_name(k): v.detach().clone().contiguous() for k, v in model.state_dict().items()
             if "positional_embedding" not in k}
    state.update(extra or {})
    if drop is not None:
        del state[drop]
    save_file(state, str(directory / "model.safetensors"))
    return directory


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>"]
WORDS = [f"w{i}" for i in range(80)] + SPECIAL + ["<asr_text>", "language", "English", "system", "user",
                                                  "<|audio_pad|>", "assistant", "German", "[UNK]"]
WORDS += [f"x{i}" for i in range(len(WORDS), TEXT["vocab_size"])]  # every id the LLM can write decodes


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer whose ids fit the tiny config (``<|audio_pad|>`` is 90), the chat
    markers special, ``<asr_text>`` an added token that is not."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    assert WORDS.index("<|audio_pad|>") == AUDIO_TOKEN
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL + ["<|audio_pad|>"]])
    tok.add_tokens([AddedToken("<asr_text>", special=False)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "[UNK]"}))


def write_hub(cache: Path, repo: str, seed: int = 0, spread: float | None = None) -> Path:
    """A hub-cache snapshot of ``repo`` in the released layout, tokenizer included."""
    from tests.support.fastconformer import snapshot_dir

    snapshot = snapshot_dir(cache, repo)
    write_released(reference(seed, spread), snapshot)
    write_tokenizer(snapshot)
    return snapshot
