"""Parity of our UMT5 encoder against transformers' ``UMT5EncoderModel`` on a tiny random config
in float32 on the CPU, with right padding (the Wan pipeline pads every prompt to a fixed length)
and sequences long enough to reach the logarithmic relative-position buckets."""

from __future__ import annotations

import torch
from transformers import UMT5Config as HFUMT5Config
from transformers import UMT5EncoderModel

from mstar.model.wan22.umt5 import UMT5Config, UMT5Encoder

TINY = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, layer_norm_epsilon=1e-6,
            feed_forward_proj="gated-gelu", dropout_rate=0.0)


def test_encoder_parity():
    ref = UMT5EncoderModel(HFUMT5Config(**TINY)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim == 2 else 1.0) + (p.ndim == 1))
    ours = UMT5Encoder(UMT5Config.from_dict(ref.config.to_dict())).eval()
    state = ref.state_dict()
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    ids = torch.randint(1, 64, (3, 40), generator=gen)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 25:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        want = ref(ids, mask).last_hidden_state
        got = ours(ids, mask)
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"[parity] umt5: max rel err {err:.2e}")
    assert err <= 1e-5
