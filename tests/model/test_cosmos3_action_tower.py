"""Cosmos3's action pathway against diffusers' ``Cosmos3OmniTransformer`` (diffusers 0.42.1) on
tiny random configs, float32 on the CPU: whole denoise forwards with an action chunk after the
video patches (the domain-aware heads, the modality embedding, clean and noisy rows, the action
rotary positions), the reference fed by ``Cosmos3OmniPipeline``'s own packing helpers; an action
request packed beside a video-only one equals its solo forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mstar.model.cosmos3.config import Cosmos3Config
from mstar.model.cosmos3.layout import action_positions, media_offset, patch_grid, text_positions, video_positions
from mstar.model.cosmos3.transformer import ActionTokens, Cosmos3Transformer, MediaItem
from tests.support.diffusers_dirs import randomize

pytest.importorskip("diffusers")

TINY = dict(head_dim=16, hidden_size=32, intermediate_size=48, latent_channel=4, latent_patch_size=2,
            num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16,
            rope_theta=10000.0, vocab_size=64, rope_axes_dim=[4, 2, 2],
            unified_3d_mrope_temporal_modality_margin=50, action_gen=True, action_dim=7, num_embodiment_domains=10)
NANO = TINY
EDGE = dict(TINY, hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True,
            enable_fps_modulation=False)
SHIFTED = dict(TINY, unified_3d_mrope_reset_spatial_ids=False)


def build(kwargs):
    from diffusers import Cosmos3OmniTransformer

    ref = Cosmos3OmniTransformer(**kwargs).eval()
    randomize(ref, 0)
    ours = Cosmos3Transformer(Cosmos3Config.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)  # the same names, both ways
    return ref, ours


def ref_forward(ref, ids, latents, actions, timestep, noisy, action_clean, domain, fps):
    """The reference's vision and action predictions, packed by the pipeline's helpers."""
    from diffusers import Cosmos3OmniPipeline

    host = SimpleNamespace(transformer=ref, vae_scale_factor_temporal=4)
    text = Cosmos3OmniPipeline._prepare_text_segment(host, ids.tolist(), device="cpu")
    clean = [f for f in range(latents.shape[1]) if f not in noisy]
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        host, latents[None], has_image_condition=bool(clean), mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=fps, curr=text["und_len"], device="cpu", condition_frame_indexes=clean)
    action = Cosmos3OmniPipeline._prepare_action_segment(
        host, actions, condition_frame_indexes=action_clean, mrope_offset=text["vision_start_temporal_offset"],
        action_fps=fps, curr=text["und_len"] + vision["num_vision_tokens"], device="cpu")
    out = ref(input_ids=text["input_ids"], text_indexes=text["text_indexes"],
              position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"], action["action_mrope_ids"]],
                                     dim=1),
              und_len=text["und_len"],
              sequence_length=text["und_len"] + vision["num_vision_tokens"] + action["action_len"],
              vision_tokens=[latents[None]], vision_token_shapes=vision["vision_token_shapes"],
              vision_sequence_indexes=vision["vision_sequence_indexes"],
              vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
              vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), float(timestep)),
              vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"],
              action_tokens=[actions], action_token_shapes=action["action_token_shapes"],
              action_sequence_indexes=action["action_sequence_indexes"],
              action_mse_loss_indexes=action["action_mse_loss_indexes"],
              action_timesteps=torch.full((action["num_noisy_action_tokens"],), float(timestep)),
              action_noisy_frame_indexes=action["action_noisy_frame_indexes"],
              action_domain_ids=[torch.tensor([domain])], return_dict=False)
    return out[0][0][0], out[2][0]


def item(ours, ids, latents, actions, timestep, noisy, action_clean, domain, fps):
    config = ours.config
    text = ours.encode_text(ids, text_positions(config, len(ids)))
    offset = media_offset(config, len(ids))
    positions = video_positions(config, patch_grid(config, latents.shape), offset, fps)
    chunk = None
    if actions is not None:
        rows = [i for i in range(len(actions)) if i not in action_clean]
        chunk = ActionTokens(actions, rows, domain, action_positions(config, len(actions), offset, fps))
    return MediaItem(latents, timestep, list(noisy), positions, text, chunk)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# latents shape, noisy latent frames, actions, clean action rows, fps
CASES = {"policy": ((4, 3, 4, 6), [1, 2], 8, [], 16.0),
         "forward_dynamics": ((4, 3, 4, 4), [1, 2], 8, list(range(8)), 24.0),
         "inverse_dynamics": ((4, 2, 3, 5), [], 4, [], 15.0),
         "one_action": ((4, 1, 4, 4), [0], 1, [], 24.0)}


@pytest.mark.parametrize("kwargs", [NANO, EDGE, SHIFTED], ids=["nano", "edge", "shifted_spatial"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_with_actions(kwargs, case):
    ref, ours = build(kwargs)
    shape, noisy, length, clean, fps = CASES[case]
    gen = torch.Generator().manual_seed(2)
    latents = torch.randn(shape, generator=gen)
    actions = torch.randn(length, 7, generator=gen)
    actions[:, 5:] = 0  # a 5-wide embodiment padded to the tower's 7
    ids = torch.randint(0, 64, (9,), generator=gen)
    with torch.no_grad():
        want_v, want_a = ref_forward(ref, ids, latents, actions, 613.0, noisy, clean, 8, fps)
        got = ours.forward_media([item(ours, ids, latents, actions, 613.0, noisy, clean, 8, fps)])[0]
    assert got["video"].shape == want_v.shape and got["action"].shape == want_a.shape == (length, 7)
    if noisy:
        assert rel(got["video"], want_v) < 1e-5, rel(got["video"], want_v)
    else:
        assert not got["video"].any() and not want_v.any()
    if len(clean) < length:
        assert rel(got["action"], want_a) < 1e-5, rel(got["action"], want_a)
    else:
        assert not got["action"].any() and not want_a.any()


def test_domains_pick_their_heads():
    _, ours = build(NANO)
    gen = torch.Generator().manual_seed(4)
    latents, actions, ids = torch.randn(4, 2, 4, 4, generator=gen), torch.randn(4, 7, generator=gen), \
        torch.randint(0, 64, (6,), generator=gen)
    with torch.no_grad():
        a = ours.forward_media([item(ours, ids, latents, actions, 500.0, [1], [], 8, 24.0)])[0]["action"]
        b = ours.forward_media([item(ours, ids, latents, actions, 500.0, [1], [], 2, 24.0)])[0]["action"]
    assert rel(a, b) > 1e-2


def test_action_request_packed_beside_a_video_request():
    _, ours = build(NANO)
    gen = torch.Generator().manual_seed(3)
    act = item(ours, torch.randint(0, 64, (11,), generator=gen), torch.randn(4, 3, 4, 6, generator=gen),
               torch.randn(8, 7, generator=gen), 900.0, [1, 2], [], 8, 24.0)
    video = item(ours, torch.randint(0, 64, (5,), generator=gen), torch.randn(4, 2, 6, 4, generator=gen), None,
                 400.0, [0, 1], [], 0, 24.0)
    inverse = item(ours, torch.randint(0, 64, (7,), generator=gen), torch.randn(4, 2, 4, 4, generator=gen),
                   torch.randn(4, 7, generator=gen), 100.0, [], [], 3, 24.0)
    with torch.no_grad():
        packed = ours.forward_media([act, video, inverse])
        for one, got in zip([act, video, inverse], packed):
            solo = ours.forward_media([one])[0]
            assert solo.keys() == got.keys()
            for key in solo:
                assert torch.allclose(got[key], solo[key], rtol=0, atol=1e-6 * float(solo[key].abs().max() + 1e-9))


def test_action_checkpoint_loads_with_coverage_both_ways(tmp_path):
    from safetensors.torch import save_file

    from mstar.model.weights import WeightLoadError, iter_safetensors, load_weights

    ref, _ = build(NANO)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "tower.safetensors")
    tower = Cosmos3Transformer(Cosmos3Config.from_dict(dict(ref.config)))
    load_weights(tower, iter_safetensors(tmp_path))
    for name, tensor in ref.state_dict().items():
        assert torch.equal(tower.state_dict()[name], tensor), name
    tensors = dict(iter_safetensors(tmp_path))
    for name in ("action_proj_in.fc.weight", "action_proj_out.bias.weight", "action_modality_embed"):
        with pytest.raises(WeightLoadError, match=f"did not fill.*{name}"):
            load_weights(Cosmos3Transformer(tower.config), {k: v for k, v in tensors.items() if k != name}.items())
    plain = Cosmos3Transformer(Cosmos3Config.from_dict({**dict(ref.config), "action_gen": False}))
    with pytest.raises(WeightLoadError, match="nothing loads.*action_"):
        load_weights(plain, tensors.items())
