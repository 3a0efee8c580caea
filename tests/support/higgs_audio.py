"""A tiny Higgs Audio v3 STT checkpoint in the release's layout (``config.json`` with
``text_config`` and ``audio_encoder_config``, ``tokenizer.json``, ``model.safetensors`` with
top-level ``audio_tower.*``, ``audio_encoder_proj.*``, ``embed_tokens``, ``layers.*``,
``norm`` and ``audio_decoder_proj.*`` keys) in a hub-cache directory, and the reference
modules it was written from: transformers' ``WhisperEncoder`` (the tower's layers),
a projector built from plain torch modules, transformers' ``Qwen3ForCausalLM``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.support.fastconformer import snapshot_dir

REPO = "bosonai/higgs-audio-v3-stt"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
WORDS = ["user", "assistant", "Transcribe", "the", "speech.", "Output", "only", "spoken", "words", "in",
         "lowercase", "with", "no", "punctuation.", "Say", "what", "you", "hear", "."]
VOCAB = 96  # the LLM's embedding rows (more than the tokenizer's 64 entries)
N_MELS, D_AUDIO, HIDDEN, PROJ = 16, 32, 48, 40
CHUNK_SECONDS = 0.5  # 50 mel frames a slice (the tower takes up to 64)


def tokenizer() -> Tokenizer:
    words = WORDS + [f"w{i}" for i in range(64 - len(SPECIALS) - len(WORDS))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    return tok


def whisper_config():
    from transformers import WhisperConfig

    return WhisperConfig(vocab_size=8, num_mel_bins=N_MELS, d_model=D_AUDIO, encoder_layers=2,
                         encoder_attention_heads=4, encoder_ffn_dim=64, decoder_layers=1, decoder_attention_heads=4,
                         decoder_ffn_dim=64, max_source_positions=32, max_target_positions=16, dropout=0.0,
                         attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=0,
                         eos_token_id=0, decoder_start_token_id=1)


def qwen_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       tie_word_embeddings=False, rope_theta=10000.0, eos_token_id=0)


def release_config() -> dict:
    """The tiny ``config.json``: the release's sections and keys, tiny sizes."""
    ids = {t: i for i, t in enumerate(SPECIALS)}
    text = qwen_config().to_dict()
    text["tie_word_embeddings"] = True  # as the release's says; its head is stored apart anyway
    w = whisper_config()
    return {"architectures": ["HiggsAudio3Model"], "model_type": "higgs_audio_3", "text_config": text,
            "audio_encoder_config": {"d_model": w.d_model, "encoder_layers": w.encoder_layers,
                                     "encoder_attention_heads": w.encoder_attention_heads,
                                     "encoder_ffn_dim": w.encoder_ffn_dim, "num_mel_bins": N_MELS,
                                     "max_source_positions": w.max_source_positions,
                                     "activation_function": "gelu", "model_type": "whisper"},
            "audio_adapter_type": "mlp", "projector_temporal_downsample": 2, "projector_hidden_size": PROJ,
            "audio_in_token_idx": ids["<|AUDIO|>"], "audio_bos_token_id": ids["<|audio_bos|>"],
            "audio_eos_token_id": ids["<|audio_eos|>"], "pad_token_id": ids["<|endoftext|>"],
            "chunk_size_seconds": CHUNK_SECONDS, "encode_whisper_embed": True}


class Projector(torch.nn.Module):
    """The projector as public code describes it, from plain torch modules."""

    def __init__(self) -> None:
        super().__init__()
        self.temporal = torch.nn.Conv1d(D_AUDIO, D_AUDIO, 3, stride=2, padding=1, groups=D_AUDIO)
        self.linear1 = torch.nn.Linear(D_AUDIO, PROJ)
        self.linear2 = torch.nn.Linear(PROJ, HIDDEN)


def reference(seed: int = 0):
    """Random reference modules ``(whisper_encoder, projector, qwen3)`` (eval, float32)."""
    from transformers import Qwen3ForCausalLM
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(seed)
    config = whisper_config()
    config._attn_implementation = "eager"
    encoder = WhisperEncoder(config).eval()
    with torch.no_grad():  # the positions are learned in the release: not the sinusoid init
        encoder.embed_positions.weight.normal_(0, 0.5)
    projector = Projector().eval()
    llm = Qwen3ForCausalLM(qwen_config()).eval()
    with torch.no_grad():
        for p in llm.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))  # norms away from 1
    return encoder, projector, llm


def release_tensors(encoder, projector, llm) -> dict[str, torch.Tensor]:
    tensors = {f"audio_tower.{k}": v.clone() for k, v in encoder.state_dict().items()}
    tensors.update({f"audio_encoder_proj.{k}": v.clone() for k, v in projector.state_dict().items()})
    for k, v in llm.state_dict().items():
        if k == "lm_head.weight":
            tensors["audio_decoder_proj.text_lm_head.weight"] = v.clone()
        else:
            tensors[k.removeprefix("model.")] = v.clone()
    # the audio-out side the STT model carries but never uses
    tensors["audio_decoder_proj.audio_lm_head.weight"] = torch.zeros(8 * 10, HIDDEN)
    tensors["audio_codebook_embeddings.weight"] = torch.zeros(8 * 10, HIDDEN)
    return tensors


def write_higgs_audio(root: Path, seed: int = 0):
    """The tiny checkpoint under the hub cache ``root``; returns the reference modules."""
    from safetensors.torch import save_file

    refs = reference(seed)
    snapshot = snapshot_dir(root, REPO)
    save_file(release_tensors(*refs), snapshot / "model.safetensors")
    (snapshot / "config.json").write_text(json.dumps(release_config()))
    tokenizer().save(str(snapshot / "tokenizer.json"))
    (snapshot / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                                "pad_token": "<|endoftext|>"}))
    return refs


def reference_tower(encoder, mel: torch.Tensor) -> torch.Tensor:
    """transformers' Whisper conv stem, positions and layers, then the pool and the norm."""
    x = F.gelu(encoder.conv2(F.gelu(encoder.conv1(mel)))).permute(0, 2, 1)
    x = x + encoder.embed_positions.weight[:x.shape[1]]
    for layer in encoder.layers:
        x = layer(x, None)
    x = torch.nn.AvgPool1d(2, 2)(x.permute(0, 2, 1)).permute(0, 2, 1)
    return encoder.layer_norm(x)


def reference_projector(projector, frames: torch.Tensor) -> torch.Tensor:
    """By hand: each channel's 3-tap stride-2 filter over time (zero-padded), then the MLP."""
    x = F.pad(frames, (0, 0, 1, 1))  # [B, S + 2, C]
    taps = projector.temporal.weight[:, 0, :]  # [C, 3]
    out = torch.stack([(x[:, 2 * j:2 * j + 3] * taps.T).sum(1) for j in range((frames.shape[1] + 1) // 2)], 1)
    out = out + projector.temporal.bias
    hidden = torch.clamp(out @ projector.linear1.weight.T + projector.linear1.bias, min=0)
    return hidden @ projector.linear2.weight.T + projector.linear2.bias


def reference_transcript(refs, tok: Tokenizer, audio, instruction: str, max_new: int) -> list[int]:
    """The greedy transcript ids (with the end token, if reached) of the reference pipeline:
    each 0.5 s slice's log-mel by transformers' ``WhisperFeatureExtractor``, the tower and
    projector references, the embeddings concatenated between ``<|audio_bos|>`` and
    ``<|audio_eos|>``, ``Qwen3ForCausalLM.generate`` over the input embeddings."""
    from transformers import WhisperFeatureExtractor

    encoder, projector, llm = refs
    extractor = WhisperFeatureExtractor(feature_size=N_MELS)
    step = int(CHUNK_SECONDS * 16000)
    pieces = []
    for start in range(0, len(audio), step):
        piece = audio[start:start + step]
        if len(piece) // 160 < 3:
            continue
        mel = extractor(piece, sampling_rate=16000, padding="longest", return_tensors="pt").input_features
        with torch.no_grad():
            pieces.append(reference_projector(projector, reference_tower(encoder, mel))[0])
    ids = {t: i for i, t in enumerate(SPECIALS)}
    before = tok.encode(f"<|im_start|>user\n{instruction} ", add_special_tokens=False).ids + [ids["<|audio_bos|>"]]
    after = [ids["<|audio_eos|>"]] + tok.encode("\n<|im_end|>\n<|im_start|>assistant\n",
                                                add_special_tokens=False).ids
    stop = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    with torch.no_grad():
        embed = llm.get_input_embeddings()
        inputs = torch.cat([embed(torch.tensor(before)), *pieces, embed(torch.tensor(after))])
        out = llm.generate(inputs_embeds=inputs[None], max_new_tokens=max_new, do_sample=False, eos_token_id=stop,
                           pad_token_id=0)
    tokens = out[0].tolist()
    ends = [i for i, t in enumerate(tokens) if t in stop]
    return tokens[:ends[0] + 1] if ends else tokens
