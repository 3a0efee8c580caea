"""Parity of the LTX-2.x joint audio-video DiT against diffusers' ``LTX2VideoTransformer3DModel``
on tiny random configs in float32 on the CPU, one per variant of the block: LTX-2.0
(interleaved rotary, the DiT projects the prompt), LTX-2.3 (split rotary, gates, the prompt's
modulation following the time) and LTX-2.5 (the prompt's modulation a fixed table, bias-free
feed-forwards, the keyframe embedding). Video and audio use different head counts so the
audio-video attentions' rotary grouping is exercised."""

from __future__ import annotations

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel

from mstar.model.ltx2_5.config import LtxTransformerConfig
from mstar.model.ltx2_5.transformer import LtxTransformer
from tests.support.diffusers_dirs import randomize

TOL = 1e-5
BASE = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            audio_in_channels=6, audio_out_channels=6, audio_num_attention_heads=4, audio_attention_head_dim=2,
            audio_cross_attention_dim=8, num_layers=2, caption_channels=12, pos_embed_max_pos=20,
            base_height=256, base_width=256, vae_scale_factors=(8, 32, 32))
VARIANTS = {
    "ltx2_0": dict(rope_type="interleaved"),
    "ltx2_3": dict(rope_type="split", gated_attn=True, audio_gated_attn=True, cross_attn_mod=True,
                   audio_cross_attn_mod=True, use_prompt_embeddings=False),
    "ltx2_5": dict(rope_type="split", gated_attn=True, audio_gated_attn=True, cross_attn_mod=True,
                   audio_cross_attn_mod=True, use_prompt_embeddings=False, ff_bias=False, audio_ff_bias=False,
                   use_prompt_adaln_single=False, use_keyframes_abs_pos_embedding=True),
}
GRID = (3, 2, 3)
AUDIO_FRAMES = 5


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


def build(variant: str):
    ref = LTX2VideoTransformer3DModel(**BASE, **VARIANTS[variant]).eval()
    randomize(ref, 0, spread=0.3, weight_gain=1.5)
    ours = LtxTransformer(LtxTransformerConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def inputs(ours: LtxTransformer, batch: int = 2):
    c = ours.config
    gen = torch.Generator().manual_seed(1)
    text_width = c.caption_channels if c.use_prompt_embeddings else c.dim
    audio_text_width = c.caption_channels if c.use_prompt_embeddings else c.audio_dim
    mask = torch.ones(batch, 6)
    mask[1, 4:] = 0  # the second prompt is two tokens shorter
    return dict(video=torch.randn(batch, GRID[0] * GRID[1] * GRID[2], c.in_channels, generator=gen),
                audio=torch.randn(batch, AUDIO_FRAMES, c.audio_in_channels, generator=gen),
                text=torch.randn(batch, 6, text_width, generator=gen),
                audio_text=torch.randn(batch, 6, audio_text_width, generator=gen),
                mask=mask, t=torch.tensor([1000.0, 421.5])[:batch])


def reference(ref, x, **kw):
    return ref(hidden_states=x["video"], audio_hidden_states=x["audio"], encoder_hidden_states=x["text"],
               audio_encoder_hidden_states=x["audio_text"], timestep=x["t"], sigma=x["t"],
               encoder_attention_mask=x["mask"], audio_encoder_attention_mask=x["mask"], num_frames=GRID[0],
               height=GRID[1], width=GRID[2], fps=24.0, audio_num_frames=AUDIO_FRAMES, return_dict=False, **kw)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_transformer_parity(variant):
    ours, ref = build(variant)
    assert set(ours.state_dict()) == set(ref.state_dict())
    x = inputs(ours)
    for cross_timestep in (True, False):
        with torch.no_grad():
            want_v, want_a = reference(ref, x, use_cross_timestep=cross_timestep)
            got_v, got_a = ours(x["video"], x["audio"], x["text"], x["audio_text"], x["t"], grid=GRID, fps=24.0,
                                text_mask=x["mask"], cross_timestep=cross_timestep)
        check(f"{variant} video cross_timestep={cross_timestep}", got_v, want_v)
        check(f"{variant} audio cross_timestep={cross_timestep}", got_a, want_a)


def test_coords_follow_diffusers():
    ours, ref = build("ltx2_5")
    want = ref.rope.prepare_video_coords(1, *GRID, torch.device("cpu"), fps=25.0)
    torch.testing.assert_close(ours.video_coords(GRID, 25.0), want, rtol=0, atol=0)
    want = ref.audio_rope.prepare_audio_coords(1, AUDIO_FRAMES, torch.device("cpu"))
    torch.testing.assert_close(ours.audio_coords(AUDIO_FRAMES), want, rtol=0, atol=0)


def test_keyframes_and_audio_time():
    """LTX-2.5's keyframe embedding on marked tokens, and a separate audio time (image-to-video
    runs the audio at another time than the partly clean video)."""
    ours, ref = build("ltx2_5")
    with torch.no_grad():
        ref.keyframes_abs_pos_embedding.normal_(generator=torch.Generator().manual_seed(3))
        ours.keyframes_abs_pos_embedding.copy_(ref.keyframes_abs_pos_embedding)
    x = inputs(ours)
    keyframes = torch.zeros(2, x["video"].shape[1], 1)
    keyframes[:, :GRID[1] * GRID[2]] = 1
    audio_t = torch.tensor([700.0, 100.0])
    with torch.no_grad():
        want_v, want_a = reference(ref, x, audio_timestep=audio_t, use_cross_timestep=False,
                                   video_keyframes_mask=keyframes)
        got_v, got_a = ours(x["video"], x["audio"], x["text"], x["audio_text"], x["t"], grid=GRID,
                            text_mask=x["mask"], audio_t=audio_t, cross_timestep=False, keyframes_mask=keyframes)
    check("keyframes video", got_v, want_v)
    check("keyframes audio", got_a, want_a)


def test_config_refuses_unknown_keys():
    with pytest.raises(ValueError, match="unknown"):
        LtxTransformerConfig.from_dict({"num_layers": 1, "bogus": 3})


def test_bfloat16_is_bit_identical():
    """In bfloat16 (diffusers keeps no LTX-2 DiT module in float32) our DiT rounds as diffusers'
    does: the outputs are equal bit for bit on the CPU."""
    ours, ref = build("ltx2_5")
    ours, ref = ours.to(torch.bfloat16), ref.to(torch.bfloat16)
    x = {k: v.to(torch.bfloat16) if v.is_floating_point() and k not in ("t", "mask") else v
         for k, v in inputs(ours).items()}
    with torch.no_grad():
        want_v, want_a = reference(ref, x, use_cross_timestep=True)
        got_v, got_a = ours(x["video"], x["audio"], x["text"], x["audio_text"], x["t"], grid=GRID,
                            text_mask=x["mask"])
    assert torch.equal(got_v, want_v) and torch.equal(got_a, want_a)
