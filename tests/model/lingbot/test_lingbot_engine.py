"""The rollout engine on a tiny random DiT and Wan2.1 VAE, float32 on the CPU: its streamed
condition encode equals the VAE's whole-clip encode of [image, black frames], a rollout in one
request equals the same rollout detached after a chunk and attached to a second request (what a
session store does to resume), and release frees the rollout."""

from __future__ import annotations

import torch

from mstar.engine.base import EngineItem
from mstar.model.lingbot.camera import relative_poses
from mstar.model.lingbot.config import LingbotConfig
from mstar.model.lingbot.engine import RolloutVAE, WorldEngine
from mstar.model.lingbot.transformer import LingbotTransformer
from mstar.model.wan22.config import WanTransformerConfig
from mstar.model.wan22.vae import WanVAE, WanVAEConfig
from tests.support.diffusers_dirs import randomize

VAE = dict(base_dim=4, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[False, True, True], is_residual=False,
           latents_mean=[0.1, -0.2, 0.3, 0.05], latents_std=[1.5, 0.7, 2.0, 1.1])
CONFIG = LingbotConfig(dit=WanTransformerConfig(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                                in_channels=12, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=40,
                                                num_layers=2, rope_max_seq_len=64),
                       vae_stride=(4, 8, 8), chunk_frames=2, window_frames=3)


def make_engine() -> WorldEngine:
    dit = LingbotTransformer(CONFIG).eval()
    randomize(dit, 0, spread=0.3, weight_gain=1.5)
    vae = WanVAE(WanVAEConfig.from_dict(VAE)).eval()
    randomize(vae, 1, gains=("gamma",))
    return WorldEngine(dit, vae, torch.device("cpu"))


def item(request_id: str, iteration: int, chunks: int = 3) -> EngineItem:
    gen = torch.Generator().manual_seed(5)
    frames = chunks * CONFIG.chunk_frames
    angles = torch.linspace(0, 0.5, frames, dtype=torch.float64)
    poses = torch.eye(4, dtype=torch.float64).repeat(frames, 1, 1)
    poses[:, 0, 0], poses[:, 0, 2], poses[:, 2, 0], poses[:, 2, 2] = angles.cos(), angles.sin(), -angles.sin(), \
        angles.cos()
    poses[:, 2, 3] = torch.arange(frames) * 0.2
    inputs = {"text": torch.randn(7, 16, generator=gen), "pixels": torch.rand(3, 1, 32, 48, generator=gen) * 2 - 1,
              "camera": relative_poses(poses).float()}
    return EngineItem(request_id, "chunk", iteration, inputs, {"seed": 9, "intrinsics": [40.0, 40.0, 24.0, 16.0]})


def test_streamed_condition_equals_whole_clip_encode():
    engine = make_engine()
    image = torch.rand(1, 3, 1, 32, 48, generator=torch.Generator().manual_seed(2)) * 2 - 1
    streamed = RolloutVAE(engine.vae, image)
    with torch.no_grad():
        got = torch.cat([streamed.condition(2), streamed.condition(4)[:, :, 2:]], dim=2)
        clip = torch.cat([image, torch.zeros(1, 3, 12, 32, 48)], dim=2)
        want = engine.vae.normalize(engine.vae.encode(clip))
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"[parity] streamed condition vs whole encode: {err:.2e}")
    assert err <= 1e-5


def test_resumed_rollout_equals_one_request():
    one = make_engine()
    whole = [one.run([item("a", i)])[0].outputs["frames"] for i in range(3)]
    assert [f.shape[0] for f in whole] == [5, 8, 8]  # 1 + 4 (c - 1) frames, then 4c

    two = make_engine()
    first = two.run([item("b", 0)])[0].outputs["frames"]
    rollout = two.detach("b")
    assert rollout is not None and rollout.chunks == 1 and "b" not in two.rollouts
    two.attach("c", rollout)
    rest = [two.run([item("c", i)])[0].outputs["frames"] for i in (1, 2)]  # the new request's own chunks 1, 2
    assert all(torch.equal(a, b) for a, b in zip(whole, [first, *rest]))
    assert rollout.cache.frames == 6 and rollout.cache.tokens() == 3 * 6  # the window holds 3 frames
    two.release("c")
    assert not two.rollouts
