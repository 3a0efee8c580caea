"""A tiny random whole Qwen3-Omni written as a hub-like checkpoint directory, for the tests that
serve it (in process, and over HTTP): ``config.json`` (transformers' whole-model config of
``reference_omni``), a byte-level tokenizer with the chat and media tokens at the ids
``tests/support/qwen3_omni.py`` gives them and a chat template that places audio, image
and video parts, small-image and small-video preprocessor configs, and the weights in the release's key layout over two
shards. ``deployment_config`` is the fp32 CPU deployment both tests serve it with."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import soundfile as sf
from safetensors.torch import save_file
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer

from tests.support.qwen3_omni import (
    AUDIO_END,
    AUDIO_START,
    AUDIO_TOKEN,
    CHAT,
    IMAGE_TOKEN,
    NEWLINE,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    reference_omni,
    released_code2wav_keys,
    released_keys,
    talker_released_keys,
)

# the tiny vocabulary (160): byte-level characters below 140, then the chat and media tokens
NAMED = {CHAT["im_start_token_id"]: "<|im_start|>", CHAT["im_end_token_id"]: "<|im_end|>",
         CHAT["system_token_id"]: "system", CHAT["user_token_id"]: "user", CHAT["assistant_token_id"]: "assistant",
         CHAT["tts_pad_token_id"]: "<tts_pad>", CHAT["tts_bos_token_id"]: "<tts_text_bos>",
         CHAT["tts_eos_token_id"]: "<tts_text_eod>", NEWLINE: "\u010a", 149: "<|endoftext|>",
         AUDIO_TOKEN: "<|audio_pad|>", IMAGE_TOKEN: "<|image_pad|>", VIDEO_TOKEN: "<|video_pad|>",
         AUDIO_START: "<|audio_start|>", VISION_START: "<|vision_start|>", AUDIO_END: "<|audio_end|>",
         VISION_END: "<|vision_end|>", 157: "<|fill_a|>", 158: "<|fill_b|>", 159: "<|fill_c|>"}
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'audio' %}{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# the codec's chunks in the served tests: 3, 4, then 5 frames, each behind 8 frames of context
SCHEDULE, CHUNK, CONTEXT = [3, 4], 5, 8
MAX_FRAMES = 14


def tokenizer() -> Qwen2Tokenizer:
    alphabet = sorted(ByteLevel.alphabet())
    ascii_first = [c for c in alphabet if "!" <= c <= "~"] + ["\u0120"]  # printable ASCII and the space
    rest = [c for c in alphabet if c not in ascii_first and c != "\u010a"]
    chars = (ascii_first + rest)[:140]
    vocab = {c: i for i, c in enumerate(chars)} | {name: i for i, name in NAMED.items()}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", unk_token=None)
    tok.add_tokens(["system", "user", "assistant"])
    tok.add_tokens([n for n in NAMED.values() if n.startswith("<")], special_tokens=True)
    tok.chat_template = TEMPLATE
    return tok


def write_checkpoint(directory: Path) -> Path:
    """``reference_omni()`` as a released-layout directory (config, tokenizer, two shards)."""
    reference = reference_omni()
    tok = tokenizer()
    tok.save_pretrained(directory)
    assert [tok.convert_tokens_to_ids(n) for n in NAMED.values()] == list(NAMED)
    config = reference.config.to_dict()
    config["im_end_token_id"] = CHAT["im_end_token_id"]
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "preprocessor_config.json").write_text(json.dumps(  # small images: a few dozen patches
        {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
         "size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}}))
    (directory / "video_preprocessor_config.json").write_text(json.dumps(  # small frames: 16 to 24 patches
        {"size": {"shortest_edge": 16 * 16, "longest_edge": 24 * 16}, "image_mean": [0.5] * 3,
         "image_std": [0.5] * 3}))
    tensors = (released_keys(reference.thinker) + talker_released_keys(reference.talker)
               + released_code2wav_keys(reference.code2wav))
    half = len(tensors) // 2  # two shards, as the release has many
    for i, part in enumerate((tensors[:half], tensors[half:])):
        shard = directory / f"model-0000{i + 1}-of-00002.safetensors"
        save_file({name: t.contiguous() for name, t in part}, str(shard))
    return directory


def deployment_config(checkpoint: Path) -> dict:
    """fp32 on the CPU, the thinker on one node group and the talker with code2wav on another
    (both rank 0), short clips and few frames so that a spoken answer takes a fraction of a second."""
    return {"model": "qwen3_omni", "model_path": str(checkpoint), "dtype": "float32", "max_seq_len": 256,
            "max_concurrent_requests": 4, "resources": {"kv_cache": {"max_num_pages": 96, "page_size": 16}},
            "node_groups": [{"node_names": ["thinker"], "ranks": [0]},
                            {"node_names": ["talker", "code2wav"], "ranks": [0]}],
            "model_kwargs": {"codec_chunk_schedule": SCHEDULE, "codec_chunk_frames": CHUNK,
                             "codec_left_context": CONTEXT, "max_speech_frames": MAX_FRAMES,
                             "talker_kv_pages": 64, "max_audio_seconds": 2.0}}


def wav(seconds: float, seed: int, rate: int = 22050) -> bytes:
    """A WAV file of a 330 Hz tone under a little noise."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).normal(0, 0.05, t.shape)
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 330 * t) + noise).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def mp4(frames: int, size: tuple[int, int], fps: float, seed: int, sound: bool = False) -> bytes:
    """An H.264 mp4 (PyAV) of ``frames`` random frames of ``size`` (width, height) at ``fps``;
    ``sound``: with an AAC track as long as the frames (a 330 Hz tone under noise, 48 kHz)."""
    from mstar.media.video import encode_mp4

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (frames, size[1], size[0], 3), dtype=np.uint8)
    if not sound:
        return encode_mp4(pixels, fps=fps)
    t = np.arange(int(frames / fps * 48000)) / 48000
    track = 0.3 * np.sin(2 * np.pi * 330 * t) + rng.normal(0, 0.05, t.shape)
    return encode_mp4(pixels, fps=fps, audio=track[None].astype(np.float32), sample_rate=48000)
