"""Record Omnilingual ASR's own outputs for ``test_omniasr_reference.py`` (run once, in its own venv).

``omnilingual-asr==0.2.0`` pins fairseq2 0.5-0.6 (torch 2.8) and Python <= 3.12.0, so it
cannot sit beside our torch; this script runs in a separate environment (pyarrow 17: the
resolver's newest needs NumPy 2, which fairseq2 0.6 does not take):

    python3.11 -m venv /tmp/omni311
    /tmp/omni311/bin/pip install omnilingual-asr==0.2.0 torchaudio==2.8.0 sentencepiece pyarrow==17.0.0
    /tmp/omni311/bin/python tests/model/omniasr/record_reference.py tests/model/omniasr/fixtures

It writes, with the versions that made them:

- ``ctc_tiny.pt``: a tiny random fairseq2 ``Wav2Vec2AsrModel`` (the 300m arch's choices:
  layer-normed convolutions with bias, pre-norm layers, a weight-normed position conv) as its
  state dict, in the release's layout, with a padded batch of normalised waveforms, their
  lengths and the model's logits and output lengths;
- ``normalize.pt``: a clip and the reference's ``apply_audio_normalization`` of it;
- ``tokenizer.model``: a small SentencePiece model (trained here), and in ``decode.json`` the
  text the reference's CTC decoding (argmax runs collapsed, the ``char_tokenizer`` decoder
  skipping special tokens) gives for fixed per-frame id sequences.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

import torch

SEED = 0
VOCAB_TEXT = ("the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs. "
              "sphinx of black quartz judge my vow. how vexingly quick daft zebras jump!")


def versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in ("omnilingual-asr", "fairseq2", "fairseq2n", "torch")}


def tiny_model(vocab_size: int):
    from fairseq2.models.transformer import TransformerNormOrder
    from fairseq2.models.wav2vec2 import Wav2Vec2EncoderConfig
    from fairseq2.models.wav2vec2.asr import Wav2Vec2AsrConfig, create_wav2vec2_asr_model

    encoder = Wav2Vec2EncoderConfig(
        model_dim=32, feature_dim=16, use_fbank=False, first_pass_dropout_p=0.0, layer_norm_features=False,
        feature_extractor_layer_descs=[(16, 10, 5), (16, 3, 2), (16, 2, 2)], feature_extractor_bias=True,
        feature_extractor_layer_norm_convs=True, feature_grad_scale=1.0, pos_encoder_type="conv",
        pos_encoder_depth=1, pos_conv_kernel_size=16, num_pos_conv_groups=4, use_conformer=False,
        num_encoder_layers=2, num_encoder_attn_heads=4, ffn_inner_dim=64, dropout_p=0.0, attn_dropout_p=0.0,
        ffn_inner_dropout_p=0.0, layer_drop_p=0.0, norm_order=TransformerNormOrder.PRE)
    config = Wav2Vec2AsrConfig(encoder_config=encoder, target_vocab_size=vocab_size, final_dropout_p=0.0,
                               use_masking=False, max_temporal_mask_prob=0.0, max_spatial_mask_prob=0.0)
    torch.manual_seed(SEED)
    model = create_wav2vec2_asr_model(config).eval()
    with torch.no_grad():  # every tensor random, norms and biases included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def record_model(out: Path) -> None:
    from fairseq2.nn import BatchLayout
    from omnilingual_asr.datasets.utils.audio import apply_audio_normalization

    model = tiny_model(24)
    g = torch.Generator().manual_seed(1)
    lengths = [4000, 2600, 3333]
    waves = torch.zeros(len(lengths), max(lengths))
    for row, n in enumerate(lengths):
        waves[row, :n] = apply_audio_normalization(torch.randn(n, generator=g) * 0.3 + 0.05)
    with torch.no_grad():
        logits, layout = model(waves, BatchLayout.of(waves, lengths))
    torch.save({"state": {k: v.clone() for k, v in model.state_dict().items()}, "waves": waves,
                "lengths": torch.tensor(lengths), "logits": logits, "frames": torch.tensor(layout.seq_lens),
                "versions": versions()}, out / "ctc_tiny.pt")

    clip = torch.randn(3000, generator=g) * 2 + 0.5
    torch.save({"clip": clip, "normalized": apply_audio_normalization(clip), "versions": versions()},
               out / "normalize.pt")


def record_decoding(out: Path) -> None:
    import io

    import sentencepiece as spm
    from fairseq2.data.tokenizers.char import load_char_tokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(VOCAB_TEXT.split(". ")), model_writer=model,
                                   vocab_size=40, model_type="char", character_coverage=1.0,
                                   bos_id=0, pad_id=1, eos_id=2, unk_id=3, byte_fallback=False)
    path = out / "tokenizer.model"
    path.write_bytes(model.getvalue())
    tokenizer = load_char_tokenizer(path, None)
    decoder = tokenizer.create_decoder(skip_special_tokens=True)
    size = tokenizer.vocab_info.size
    g = torch.Generator().manual_seed(2)
    cases = []
    for _ in range(6):
        frames = torch.randint(0, size, (40,), generator=g)
        frames[torch.rand(40, generator=g) < 0.4] = 0  # blanks between runs
        mask = torch.ones(len(frames), dtype=torch.bool)
        mask[1:] = frames[1:] != frames[:-1]
        cases.append({"frames": frames.tolist(), "text": decoder(frames[mask])})
    (out / "decode.json").write_text(json.dumps({"versions": versions(), "vocab_size": size, "cases": cases},
                                                ensure_ascii=False) + "\n")


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "fixtures")
    target.mkdir(parents=True, exist_ok=True)
    record_model(target)
    record_decoding(target)
    print("wrote", sorted(p.name for p in target.iterdir()), versions())
