"""Cosmos3's tower against diffusers' ``Cosmos3OmniTransformer`` (diffusers 0.42.1) on tiny random
configs, float32 on the CPU: each layer's two pathways, the whole t2i / t2v / conditioned-frame
forward, a t2v forward with sound tokens (both velocities), and several requests packed into one
step equal to their solo steps. The reference's
inputs are built by the pipeline's own packing code, so the layout is checked too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mstar.model.cosmos3.config import Cosmos3Config
from mstar.model.cosmos3.layout import media_offset, patch_grid, sound_positions, text_positions, video_positions
from mstar.model.cosmos3.transformer import Cosmos3Transformer, MediaItem, Segment
from tests.support.diffusers_dirs import randomize

pytest.importorskip("diffusers")

TINY = dict(head_dim=16, hidden_size=32, intermediate_size=48, latent_channel=4, latent_patch_size=2,
            num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16,
            rope_theta=10000.0, vocab_size=64, rope_axes_dim=[4, 2, 2],
            unified_3d_mrope_temporal_modality_margin=50)
NANO = TINY
EDGE = dict(TINY, hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True,
            enable_fps_modulation=False)
ACTIONS = dict(TINY, action_gen=True, action_dim=6, num_embodiment_domains=3, sound_gen=True, sound_dim=5)


def build(kwargs):
    from diffusers import Cosmos3OmniTransformer

    ref = Cosmos3OmniTransformer(**kwargs).eval()
    randomize(ref, 0)
    ours = Cosmos3Transformer(Cosmos3Config.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)  # the same names, both ways
    return ref, ours


def ref_forward(ref, ids, latents, timestep, noisy, fps):
    """The reference's vision prediction, packed by the pipeline's own helpers."""
    from diffusers import Cosmos3OmniPipeline

    host = SimpleNamespace(transformer=ref, vae_scale_factor_temporal=4)
    text = Cosmos3OmniPipeline._prepare_text_segment(host, ids.tolist(), device="cpu")
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        host, latents[None], has_image_condition=bool(set(range(latents.shape[1])) - set(noisy)),
        mrope_offset=text["vision_start_temporal_offset"], vision_fps=fps, curr=text["und_len"], device="cpu",
        condition_frame_indexes=[f for f in range(latents.shape[1]) if f not in noisy])
    out = ref(input_ids=text["input_ids"], text_indexes=text["text_indexes"],
              position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
              und_len=text["und_len"], sequence_length=text["und_len"] + vision["num_vision_tokens"],
              vision_tokens=[latents[None]], vision_token_shapes=vision["vision_token_shapes"],
              vision_sequence_indexes=vision["vision_sequence_indexes"],
              vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
              vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), float(timestep)),
              vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"], return_dict=False)
    return out[0][0][0]


def item(ours, ids, latents, timestep, noisy, fps):
    config = ours.config
    text = ours.encode_text(ids, text_positions(config, len(ids)))
    positions = video_positions(config, patch_grid(config, latents.shape), media_offset(config, len(ids)), fps)
    return MediaItem(latents, timestep, list(noisy), positions, text)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kwargs", [NANO, EDGE], ids=["nano", "edge"])
def test_layer_pathways(kwargs):
    ref, ours = build(kwargs)
    gen = torch.Generator().manual_seed(1)
    und, media = torch.randn(7, 32, generator=gen), torch.randn(12, 32, generator=gen)
    positions = torch.cat([text_positions(ours.config, 7),
                           video_positions(ours.config, (3, 2, 2), media_offset(ours.config, 7), 24.0)], dim=1)
    with torch.no_grad():
        cos, sin = ref.rotary_emb(positions[:, None], device="cpu", dtype=torch.float32)
        cos, sin = cos[0], sin[0]
        for layer_ref, layer in zip(ref.layers, ours.layers):
            want_und, want_gen = layer_ref(und, media, (cos[:7], sin[:7], cos[7:], sin[7:]))
            got_und, kv = layer.text(und, cos[:7], sin[:7])
            got_gen = layer.media(media, cos[7:], sin[7:], [Segment(12, kv)])
            assert rel(got_und, want_und) < 1e-5
            assert rel(got_gen, want_gen) < 1e-5


CASES = {"t2i": ((4, 1, 4, 6), [0], 24.0), "t2v": ((4, 3, 4, 6), [0, 1, 2], 24.0),
         "t2v_odd_size": ((4, 3, 5, 3), [0, 1, 2], 16.0), "first_frame_clean": ((4, 3, 4, 4), [1, 2], 24.0)}


@pytest.mark.parametrize("kwargs", [NANO, EDGE, ACTIONS], ids=["nano", "edge", "action_sound_heads"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_forward(kwargs, case):
    ref, ours = build(kwargs)
    shape, noisy, fps = CASES[case]
    gen = torch.Generator().manual_seed(2)
    latents = torch.randn(shape, generator=gen)
    ids = torch.randint(0, 64, (9,), generator=gen)
    with torch.no_grad():
        want = ref_forward(ref, ids, latents, 731.0, noisy, fps)
        got = ours([item(ours, ids, latents, 731.0, noisy, fps)])[0]
    assert got.shape == want.shape
    assert rel(got, want) < 1e-5


def test_packed_step_equals_solo_steps():
    _, ours = build(NANO)
    gen = torch.Generator().manual_seed(3)
    specs = [((4, 3, 4, 6), 11, 900.0, [0, 1, 2]), ((4, 1, 6, 4), 5, 400.0, [0]), ((4, 2, 4, 4), 8, 50.0, [1])]
    items = [item(ours, torch.randint(0, 64, (n,), generator=gen), torch.randn(shape, generator=gen), t, noisy, 24.0)
             for shape, n, t, noisy in specs]
    with torch.no_grad():
        packed = ours(items)
        for one, got in zip(items, packed):
            assert rel(got, ours([one])[0]) < 1e-6


def ref_forward_with_sound(ref, ids, latents, sound, timestep, fps):
    """The reference's vision and sound predictions of a t2v step with sound, packed by the
    pipeline's own helpers (sound after the vision tokens)."""
    from diffusers import Cosmos3OmniPipeline

    host = SimpleNamespace(transformer=ref, vae_scale_factor_temporal=4)
    text = Cosmos3OmniPipeline._prepare_text_segment(host, ids.tolist(), device="cpu")
    offset = text["vision_start_temporal_offset"]
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        host, latents[None], has_image_condition=False, mrope_offset=offset, vision_fps=fps,
        curr=text["und_len"], device="cpu", condition_frame_indexes=[])
    audio = Cosmos3OmniPipeline._prepare_sound_segment(
        host, sound, mrope_offset=offset, sound_fps=float(ref.config.sound_latent_fps),
        curr=text["und_len"] + vision["num_vision_tokens"], device="cpu")
    out = ref(input_ids=text["input_ids"], text_indexes=text["text_indexes"],
              position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"], audio["sound_mrope_ids"]],
                                     dim=1),
              und_len=text["und_len"],
              sequence_length=text["und_len"] + vision["num_vision_tokens"] + audio["sound_len"],
              vision_tokens=[latents[None]], vision_token_shapes=vision["vision_token_shapes"],
              vision_sequence_indexes=vision["vision_sequence_indexes"],
              vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
              vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), float(timestep)),
              vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"],
              sound_tokens=[sound], sound_token_shapes=audio["sound_token_shapes"],
              sound_sequence_indexes=audio["sound_sequence_indexes"],
              sound_mse_loss_indexes=audio["sound_mse_loss_indexes"],
              sound_timesteps=torch.full((audio["sound_len"],), float(timestep)),
              sound_noisy_frame_indexes=audio["sound_noisy_frame_indexes"], return_dict=False)
    return out[0][0][0], out[1][0]


@pytest.mark.parametrize("kwargs, fps", [(ACTIONS, 16.0), (dict(ACTIONS, enable_fps_modulation=False), 24.0)],
                         ids=["fps_modulated", "plain_positions"])
def test_forward_with_sound(kwargs, fps):
    ref, ours = build(kwargs)
    gen = torch.Generator().manual_seed(4)
    latents, sound = torch.randn(4, 3, 4, 6, generator=gen), torch.randn(5, 7, generator=gen)
    ids = torch.randint(0, 64, (9,), generator=gen)
    with torch.no_grad():
        want_video, want_sound = ref_forward_with_sound(ref, ids, latents, sound, 613.0, fps)
        one = item(ours, ids, latents, 613.0, [0, 1, 2], fps)
        one.sound, one.sound_positions = sound, sound_positions(ours.config, 7, media_offset(ours.config, 9))
        [got] = ours.predict([one])
        plain = ours([item(ours, ids, latents, 613.0, [0, 1, 2], fps)])[0]
    assert got.sound.shape == want_sound.shape == (5, 7)
    print(f"[parity] with sound: video {rel(got.video, want_video):.1e} sound {rel(got.sound, want_sound):.1e}")
    assert rel(got.video, want_video) < 1e-5 and rel(got.sound, want_sound) < 1e-5
    assert rel(plain, want_video) > 1e-3  # the sound tokens moved the video's velocity: they were attended
