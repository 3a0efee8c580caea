"""Parity of the text connectors against diffusers' ``LTX2TextConnectors`` on tiny random
configs in float32 on the CPU: the LTX-2.0 layout (masked range norm, one projection,
interleaved rotary) and the LTX-2.3+ one (per-token RMS, a projection per stream, split rotary,
gated attention), on left-padded prompts of different lengths."""

from __future__ import annotations

import pytest
import torch
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

from mstar.model.ltx2_5.connectors import LtxConnectorsConfig, LtxTextConnectors
from tests.support.diffusers_dirs import randomize

TOL = 1e-5
BASE = dict(caption_channels=12, text_proj_in_factor=3, video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=6, video_connector_num_layers=2,
            video_connector_num_learnable_registers=4, audio_connector_num_attention_heads=2,
            audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=4, connector_rope_base_seq_len=64)
VARIANTS = {
    "ltx2_0": dict(),
    "ltx2_5": dict(per_modality_projections=True, video_hidden_dim=12, audio_hidden_dim=8, rope_type="split",
                   video_gated_attn=True, audio_gated_attn=True, proj_bias=True),
}


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_connectors_parity(variant):
    config = {**BASE, **VARIANTS[variant]}
    if variant == "ltx2_0":  # one projection to caption_channels feeds both streams
        config.update(video_connector_attention_head_dim=6, audio_connector_attention_head_dim=6)
    ref = LTX2TextConnectors(**config).eval()
    randomize(ref, 0, spread=0.3, weight_gain=1.5, offsets=("learnable_registers",))
    ours = LtxTextConnectors(LtxConnectorsConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    gen = torch.Generator().manual_seed(1)
    states = torch.randn(2, 8, 12, 3, generator=gen) * 3
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[0, :3] = 0  # left padding
    mask[1, :6] = 0
    with torch.no_grad():
        want = ref(states.flatten(2), mask)
        got = ours(states.flatten(2), mask)
    check(f"{variant} video", got[0], want[0])
    check(f"{variant} audio", got[1], want[1])
    torch.testing.assert_close(got[2], want[2])


def test_refuses_register_free_connectors():
    with pytest.raises(ValueError, match="registers"):
        LtxConnectorsConfig.from_dict({"video_connector_num_learnable_registers": None})
