"""A tiny Qwen3-TTS checkpoint directory for the served tests (``load_format: dummy``): the
talker's ``config.json`` (two built-in speakers, the variant given), a byte-level tokenizer
with the chat and TTS ids of ``tests/support/qwen3_omni.py``, and ``speech_tokenizer/`` with a
tiny 12 Hz decoder's and encoder's config. No weights: a dummy deployment draws them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.support.qwen3_omni import CHAT
from tests.support.qwen3_omni_dir import tokenizer

TALKER = dict(
    code_predictor_config=dict(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=4),
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_code_groups=4, text_hidden_size=48, text_vocab_size=200,
    rope_scaling={"mrope_section": [2, 1, 1], "interleaved": True, "rope_type": "default"},
    codec_eos_token_id=100, codec_pad_id=101, codec_bos_id=102, codec_think_id=103, codec_nothink_id=104,
    codec_think_bos_id=105, codec_think_eos_id=106, spk_id={"vivian": 110, "ryan": 111},
    spk_is_dialect={"vivian": False, "ryan": False}, codec_language_id={"english": 112, "chinese": 113})
CODEC = dict(codebook_size=64, codebook_dim=16, hidden_size=16, latent_dim=16, num_attention_heads=2,
             num_key_value_heads=2, sliding_window=8, intermediate_size=32, num_hidden_layers=1, num_quantizers=4,
             upsample_rates=[4, 3], upsampling_ratios=[2, 2], decoder_dim=16)
# the codec's encoder: 4 of 6 codebooks of 64 codes (the talker's), 48 samples a frame like the decoder
ENCODER = dict(frame_rate=500.0, hidden_size=16, num_filters=4, upsampling_ratios=[6, 4], codebook_size=64,
               codebook_dim=8, vector_quantization_hidden_dimension=8, num_quantizers=6, upsample_groups=16,
               num_hidden_layers=1, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
SPEAKER = dict(mel_dim=128, enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
               enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=4, enc_se_channels=8)
SAMPLES_PER_FRAME = 48


def write_checkpoint(root: Path, variant: str = "custom_voice") -> Path:
    (root / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    tokenizer().save_pretrained(root)
    config = {"model_type": "qwen3_tts", "tts_model_type": variant, "tokenizer_type": "qwen3_tts_tokenizer_12hz",
              "talker_config": TALKER, "speaker_encoder_config": SPEAKER,
              "im_start_token_id": CHAT["im_start_token_id"], "im_end_token_id": CHAT["im_end_token_id"],
              "tts_pad_token_id": CHAT["tts_pad_token_id"],
              "tts_bos_token_id": CHAT["tts_bos_token_id"], "tts_eos_token_id": CHAT["tts_eos_token_id"]}
    (root / "config.json").write_text(json.dumps(config))
    (root / "speech_tokenizer" / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_tts_tokenizer_12hz", "output_sample_rate": 24000, "decoder_config": CODEC,
         "encoder_config": ENCODER, "encoder_valid_num_quantizers": 4, "encode_downsample_rate": SAMPLES_PER_FRAME}))
    return root


def deployment_yaml(key: str, checkpoint: Path, split: bool = False) -> str:
    """fp32 on the CPU, the talker and the codec on one worker (``split``: the codec on a second
    worker), a short ramp."""
    groups = ("  - {node_names: [talker], ranks: [0]}\n  - {node_names: [codec], ranks: [1]}\n" if split else
              "  - {node_names: [talker, codec], ranks: [0]}\n")
    return (f"model: {key}\nmodel_path: {checkpoint}\nload_format: dummy\ndtype: float32\nmax_seq_len: 256\n"
            f"max_concurrent_requests: 8\nnode_groups:\n{groups}"
            "resources:\n  kv_cache: {max_num_pages: 256, page_size: 16}\n"
            "model_kwargs: {max_new_frames: 24, codec_chunk_schedule: [1, 3, 8], codec_chunk_frames: 6, "
            "codec_left_context: 12}\n")


@torch.no_grad()
def eager_pcm(checkpoint: Path, text: str, frames: int) -> np.ndarray:
    """The int16 samples a greedy ``qwen3_tts`` request for ``text`` (speaker ``vivian``) should
    serve on ``deployment_yaml``'s settings: ``run_talker``'s frames (the loop checked against the
    reference's ``generate``) decoded over the deployment's ramp."""
    from mstar.model.qwen3_tts.checkpoint import Qwen3TTSCheckpoint
    from mstar.model.qwen3_tts.prompt import assistant_text, talker_prompt
    from mstar.model.qwen3_tts.speech import run_talker

    ckpt = Qwen3TTSCheckpoint.locate(str(checkpoint), dummy=True)
    talker = ckpt.talker("cpu", torch.float32, dummy=True, seed=0)
    codec = ckpt.codec("cpu", torch.float32, dummy=True, seed=1)
    ids = ckpt.tokenizer()(assistant_text(text), add_special_tokens=False)["input_ids"]
    prompt = talker_prompt(talker, ckpt.config(), ids, speaker="vivian", non_streaming=True)
    codes = run_talker(talker, prompt, max_frames=frames)
    assert codes.shape[1] >= 2
    wave = torch.cat(list(codec.decode_stream(codes[None], ramp=(1, 3, 8, 6), left_context=12)), dim=-1)[0]
    return np.rint(np.clip(wave.numpy(), -1, 1) * 32767).astype(int)
