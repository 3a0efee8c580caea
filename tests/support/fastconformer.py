"""Tiny FastConformer transducer checkpoints in transformers' layout, written into a directory
laid out like the Hugging Face hub cache (``models--org--name/snapshots/<sha>``), for the
checkpoint tests and the e2e servers (Hugging Face is unreachable from the tests)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    Nemotron3_5AsrConfig,
    Nemotron3_5AsrForRNNT,
    ParakeetFeatureExtractor,
    ParakeetForTDT,
    ParakeetTDTConfig,
)
from transformers.models.nemotron_asr_streaming import NemotronAsrStreamingFeatureExtractor

VOCAB, BLANK = 40, 39
ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               subsampling_conv_channels=8, num_mel_bins=16, conv_kernel_size=5, dropout=0.0, layerdrop=0.0,
               activation_dropout=0.0, attention_dropout=0.0)
WORDS = [f"w{i}" for i in range(BLANK)]
REPOS = {"parakeet": "nvidia/parakeet-tdt-0.6b-v3", "nemotron_asr": "nvidia/nemotron-3.5-asr-streaming-0.6b"}


def noise_clip(seconds: float, seed: int) -> np.ndarray:
    """``seconds`` of 16 kHz white noise (a clip every model transcribes as something)."""
    rng = np.random.default_rng(seed)
    return (0.2 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


def wav(samples: np.ndarray, subtype: str = "PCM_16") -> bytes:
    """16 kHz mono ``samples`` as a WAV file's bytes."""
    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format="WAV", subtype=subtype)
    return buf.getvalue()


def snapshot_dir(cache: Path, repo: str) -> Path:
    """An empty snapshot of ``repo`` in the hub cache at ``cache`` (refs/main names it)."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    snapshot = root / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text("b" * 40)
    return snapshot


def tokenizer() -> Tokenizer:
    """A word-level tokenizer: ids 0..38 are ``w0``..``w38``, 39 is the blank (special)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)} | {"<blank>": BLANK}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<blank>"])
    return tok


def _randomise(model: torch.nn.Module, seed: int, joint_scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            scale = 0.5 if "decoder" in name or "joint" in name or "projector" in name else 0.2
            if name.startswith("encoder.") and tensor.dim() == 1:
                scale = 0.02
            values = torch.randn(tensor.shape, generator=gen) * scale
            if name.endswith("running_var") or ("norm" in name and name.endswith("weight")):
                values = 1.0 + values.abs()
            tensor.copy_(values)
        model.joint.head.weight.mul_(joint_scale)


def write_parakeet(snapshot: Path, seed: int = 0) -> ParakeetForTDT:
    """A random tiny ``ParakeetForTDT`` saved in ``snapshot`` with its processor files; the
    model (the reference) is returned."""
    torch.manual_seed(seed)
    config = ParakeetTDTConfig(encoder_config=ENCODER, vocab_size=VOCAB, blank_token_id=BLANK, pad_token_id=2,
                               decoder_hidden_size=24, num_decoder_layers=2, durations=[0, 1, 2, 3, 4])
    model = ParakeetForTDT(config).eval()
    _randomise(model, seed + 1, joint_scale=1.0)
    with torch.no_grad():
        model.joint.head.bias[BLANK] += 2.0  # blanks often, as in speech
        model.joint.head.bias[2] = -1e4  # never the pad token
        model.joint.head.bias[VOCAB:] += torch.tensor([0.0, 2.0, 1.5, 0.5, 0.0])
    model.save_pretrained(snapshot)
    GenerationConfig(decoder_start_token_id=BLANK, pad_token_id=2).save_pretrained(snapshot)
    ParakeetFeatureExtractor(feature_size=16).save_pretrained(snapshot)
    tokenizer().save(str(snapshot / "tokenizer.json"))
    return model


def write_nemotron(snapshot: Path, seed: int = 0) -> Nemotron3_5AsrForRNNT:
    """A random tiny ``Nemotron3_5AsrForRNNT`` saved in ``snapshot`` with its processor files."""
    torch.manual_seed(seed)
    config = Nemotron3_5AsrConfig(
        encoder_config=dict(ENCODER, sliding_window=71, default_num_lookahead_tokens=13), vocab_size=VOCAB,
        blank_token_id=BLANK, pad_token_id=2, decoder_hidden_size=24, num_decoder_layers=2, max_symbols_per_step=3,
        num_prompts=128, prompt_intermediate_size=40, default_prompt_id=101)
    model = Nemotron3_5AsrForRNNT(config).eval()
    _randomise(model, seed + 1, joint_scale=0.1)
    with torch.no_grad():
        model.joint.head.bias[BLANK] += 14.0  # blanks often, as in speech
        model.joint.head.bias[2] = -1e4  # never the pad token
    model.save_pretrained(snapshot)
    GenerationConfig(decoder_start_token_id=BLANK, pad_token_id=2).save_pretrained(snapshot)
    NemotronAsrStreamingFeatureExtractor(feature_size=16, mel_filters_dtype="bfloat16").save_pretrained(snapshot)
    tokenizer().save(str(snapshot / "tokenizer.json"))
    return model


def hub_cache(root: Path) -> dict[str, torch.nn.Module]:
    """Both keys' default repos written under the hub cache ``root``; the reference models."""
    return {"parakeet": write_parakeet(snapshot_dir(root, REPOS["parakeet"])),
            "nemotron_asr": write_nemotron(snapshot_dir(root, REPOS["nemotron_asr"]))}


CANARY_SPECIALS = ["<unk>", "<|nospeech|>", "<pad>", "<|endoftext|>", "<|startoftranscript|>", "<|pnc|>",
                   "<|nopnc|>", "<|startofcontext|>", "<|noitn|>", "<|notimestamp|>", "<|nodiarize|>",
                   "<|emo:undefined|>"]
CANARY_LANGUAGES = "bg hr cs da nl en et fi fr de el hu it lv lt mt pl pt ro sk sl es sv ru uk".split()
CANARY_VOCAB = 64
CANARY_REPO = "nvidia/canary-1b-v2"


def canary_tokenizer() -> Tokenizer:
    """Canary's special tokens at their ids (pad 2, end 3, start of context 7), the 25
    language tokens, then words."""
    specials = CANARY_SPECIALS + [f"<|{code}|>" for code in CANARY_LANGUAGES]
    words = [f"w{i}" for i in range(CANARY_VOCAB - len(specials))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return tok


def write_canary(snapshot: Path, seed: int = 0, eos_bias: float = 2.0):
    """A random tiny ``CanaryForConditionalGeneration`` saved in ``snapshot`` with its processor
    files and tokenizer; the model (the reference) is returned."""
    from transformers import CanaryConfig, CanaryForConditionalGeneration

    torch.manual_seed(seed)
    encoder = dict(ENCODER, scale_input=False)
    decoder = dict(vocab_size=CANARY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=128)
    model = CanaryForConditionalGeneration(CanaryConfig(encoder_config=encoder, decoder_config=decoder,
                                                        vocab_size=CANARY_VOCAB)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and "positional_embedding" not in name:
                # wide decoder matrices: the blocks, not the tied embedding, pick the next token
                wide = name.startswith("model.decoder.layers.") and tensor.dim() == 2
                values = torch.randn(tensor.shape, generator=gen) * (0.6 if wide else 0.2)
                if name.endswith("running_var") or ("norm" in name and name.endswith("weight")):
                    values = 1.0 + values.abs()
                tensor.copy_(values)
        model.proj_out.bias[3] += eos_bias  # <|endoftext|> now and then
    model.save_pretrained(snapshot)
    ParakeetFeatureExtractor(feature_size=16).save_pretrained(snapshot)
    canary_tokenizer().save(str(snapshot / "tokenizer.json"))
    return model
