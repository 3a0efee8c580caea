"""A tiny Fish S2-Pro release for the served tests: S2's ``config.json`` (a two-layer slow AR,
a two-layer fast AR, 4 codebooks of 16), ``codec.json`` with a tiny codec at 800 Hz (8 samples
a frame) and a character ``tokenizer.json`` carrying S2's chat and semantic tokens. No
weights: a dummy deployment draws them."""

from __future__ import annotations

import json
from pathlib import Path

SEMANTIC_BEGIN = 100
CODEBOOK = 16
RATE = 800
SAMPLES_PER_FRAME = 8
CONFIG = {
    "model_type": "fish_qwen3_omni", "eos_token_id": 97, "semantic_start_token_id": SEMANTIC_BEGIN,
    "semantic_end_token_id": SEMANTIC_BEGIN + CODEBOOK - 1,
    "text_config": {"vocab_size": 128, "n_layer": 2, "n_head": 4, "n_local_heads": 2, "dim": 32, "head_dim": 8,
                    "intermediate_size": 48, "rope_base": 10000.0, "norm_eps": 1e-6, "max_seq_len": 4096,
                    "tie_word_embeddings": True, "attention_qk_norm": True},
    "audio_decoder_config": {"vocab_size": CODEBOOK, "num_codebooks": 4, "n_layer": 2, "dim": 24, "n_head": 2,
                             "n_local_heads": 1, "head_dim": 12, "intermediate_size": 40},
}
CODEC = {"sample_rate": RATE, "latent_dim": 32, "decoder_dim": 16, "decoder_rates": [2, 2],
         "semantic_codebook_size": CODEBOOK, "codebook_size": 8, "n_codebooks": 3, "codebook_dim": 4,
         "downsample_factor": [2], "n_layer": 1, "n_head": 2, "head_dim": 16, "intermediate_size": 32,
         "window_size": 4,
         "encoder": {"encoder_dim": 16, "encoder_rates": [2, 2], "encoder_transformer_layers": [0, 1],
                     "encoder_window": 6, "head_dim": 64}}
# ids 96 .. 99 in this order, then <|semantic:0..15|> at 100 .. 115
SPECIAL = ("<|im_start|>", "<|im_end|>", "<|voice|>", "<|speaker:0|>")


def write_release(directory: Path) -> Path:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, **{chr(i): i - 31 for i in range(32, 127)}}  # 96 ids: <unk> and printable ASCII
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.add_special_tokens([*SPECIAL, *(f"<|semantic:{i}|>" for i in range(CODEBOOK))])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    (directory / "codec.json").write_text(json.dumps(CODEC))
    return directory
