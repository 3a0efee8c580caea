"""A structural cross-check: transformers' ``Wav2Vec2ForCTC`` in its stable-layer-norm form
(layer-normed convolutions with bias, pre-norm layers, a final LayerNorm, a weight-normed
position convolution kept as ``original0``/``original1``) is the same network; its weights,
renamed, give the same CTC logits on a padded batch (fp32, CPU)."""

from __future__ import annotations

import re

import pytest
import torch

from mstar.model.omniasr.config import OmniAsrConfig
from mstar.model.omniasr.modeling import OmniAsrCtc
from mstar.model.weights import load_weights

transformers = pytest.importorskip("transformers")

RULES = (
    (r"wav2vec2\.feature_extractor\.conv_layers\.(\d+)\.", r"encoder_frontend.feature_extractor.layers.\1."),
    (r"wav2vec2\.feature_projection\.layer_norm\.", "encoder_frontend.post_extract_layer_norm."),
    (r"wav2vec2\.feature_projection\.projection\.", "encoder_frontend.model_dim_proj."),
    (r"wav2vec2\.encoder\.pos_conv_embed\.conv\.parametrizations\.weight\.original0",
     "encoder_frontend.pos_encoder.conv.weight_g"),
    (r"wav2vec2\.encoder\.pos_conv_embed\.conv\.parametrizations\.weight\.original1",
     "encoder_frontend.pos_encoder.conv.weight_v"),
    (r"wav2vec2\.encoder\.pos_conv_embed\.conv\.bias", "encoder_frontend.pos_encoder.conv.bias"),
    (r"wav2vec2\.encoder\.layer_norm\.", "encoder.layer_norm."),
    (r"wav2vec2\.encoder\.layers\.(\d+)\.attention\.out_proj\.", r"encoder.layers.\1.self_attn.output_proj."),
    (r"wav2vec2\.encoder\.layers\.(\d+)\.attention\.", r"encoder.layers.\1.self_attn."),
    (r"wav2vec2\.encoder\.layers\.(\d+)\.layer_norm\.", r"encoder.layers.\1.self_attn_layer_norm."),
    (r"wav2vec2\.encoder\.layers\.(\d+)\.final_layer_norm\.", r"encoder.layers.\1.ffn_layer_norm."),
    (r"wav2vec2\.encoder\.layers\.(\d+)\.feed_forward\.intermediate_dense\.", r"encoder.layers.\1.ffn.inner_proj."),
    (r"wav2vec2\.encoder\.layers\.(\d+)\.feed_forward\.output_dense\.", r"encoder.layers.\1.ffn.output_proj."),
    (r"lm_head\.", "final_proj."),
)


def rename(name: str) -> str:
    for pattern, ours in RULES:
        renamed, hits = re.subn("^" + pattern, ours, name)
        if hits:
            return renamed
    return name


@torch.no_grad()
def test_wav2vec2_for_ctc_is_the_same_network():
    config = transformers.Wav2Vec2Config(
        vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16, 16), conv_kernel=(10, 3, 2), conv_stride=(5, 2, 2), conv_bias=True,
        feat_extract_norm="layer", feat_extract_activation="gelu", hidden_act="gelu", do_stable_layer_norm=True,
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0, layer_norm_eps=1e-5,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
        layerdrop=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference = transformers.Wav2Vec2ForCTC(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    ours = OmniAsrCtc(OmniAsrConfig(model_dim=32, num_layers=2, num_heads=4, ffn_dim=64, vocab_size=30,
                                    feature_layers=((16, 10, 5), (16, 3, 2), (16, 2, 2)), pos_conv_kernel=16,
                                    pos_conv_groups=4)).eval()
    load_weights(ours, ((rename(k), v) for k, v in reference.state_dict().items()))

    g = torch.Generator().manual_seed(4)
    lengths = [4000, 2500]
    waves = torch.zeros(2, 4000)
    for row, n in enumerate(lengths):
        waves[row, :n] = torch.randn(n, generator=g)
    mask = (torch.arange(4000)[None] < torch.tensor(lengths)[:, None]).long()
    ref = reference(waves, attention_mask=mask).logits
    logits, frames = ours(waves, torch.tensor(lengths))
    for row, n in enumerate(frames.tolist()):
        err = float((logits[row, :n] - ref[row, :n]).abs().max() / ref[row, :n].abs().max())
        assert err < 1e-5, err
