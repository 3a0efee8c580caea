"""The rollout engine on a tiny random DiT and Wan2.1 VAE, float32 on the CPU: its streamed
condition encode equals the VAE's whole-clip encode of [image, black frames]; a rollout of N
chunks kept in a session store and resumed for M more equals one request of N + M chunks bit
for bit (the resumed request's own poses extending the trajectory); release frees the engine's
hold, dropping the session frees the rest."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.base import EngineItem
from mstar.model.lingbot.config import LingbotConfig
from mstar.model.lingbot.engine import RolloutVAE, WorldEngine
from mstar.model.lingbot.transformer import LingbotTransformer
from mstar.model.wan22.config import WanTransformerConfig
from mstar.model.wan22.vae import WanVAE, WanVAEConfig
from mstar.runtime.sessions import SessionHandle, SessionStore
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


def trajectory(frames: int) -> torch.Tensor:
    """Absolute latent-frame poses ``[frames, 4, 4]`` float64: turning, slowing down (the longest
    step first, so a split trajectory normalises as the whole one)."""
    angles = 0.1 * torch.arange(frames, dtype=torch.float64)
    poses = torch.eye(4, dtype=torch.float64).repeat(frames, 1, 1)
    poses[:, 0, 0], poses[:, 0, 2], poses[:, 2, 0], poses[:, 2, 2] = angles.cos(), angles.sin(), -angles.sin(), \
        angles.cos()
    poses[:, 2, 3] = torch.tensor([0.3 * (1 - 0.8 ** i) for i in range(frames)], dtype=torch.float64)
    return poses


def item(request_id: str, iteration: int, chunks: int = 3, first: int = 0, session=None,
         text_seed: int = 5, **params) -> EngineItem:
    """Iteration ``iteration`` of a request for ``chunks`` chunks from latent frame ``first`` on."""
    gen = torch.Generator().manual_seed(text_seed)
    c = CONFIG.chunk_frames
    inputs = {"text": torch.randn(7, 16, generator=gen), "pixels": torch.rand(3, 1, 32, 48, generator=gen) * 2 - 1,
              "camera": trajectory(first + chunks * c)[first:]}
    params = {"seed": 9, "intrinsics": [40.0, 40.0, 24.0, 16.0], **params}
    return EngineItem(request_id, "chunk", iteration, inputs, params, session=session)


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


def run_request(engine: WorldEngine, request_id: str, chunks: int, first: int = 0, session=None,
                **kwargs) -> list[torch.Tensor]:
    out = [engine.run([item(request_id, i, chunks, first, session, **kwargs)])[0].outputs["frames"]
           for i in range(chunks)]
    engine.release(request_id)
    return out


def test_resumed_session_equals_one_request():
    whole = run_request(make_engine(), "a", 3)
    assert [f.shape[0] for f in whole] == [5, 8, 8]  # 1 + 4 (c - 1) frames, then 4c

    engine, store = make_engine(), SessionStore()
    first = run_request(engine, "b", 1, session=SessionHandle(store, "s", "world", resume=False))
    assert not engine.rollouts and not engine.cameras and store.sessions == ["s"]
    rest = run_request(engine, "c", 2, first=2, session=SessionHandle(store, "s", "world", resume=True))
    got = [*first, *rest]
    assert all(torch.equal(a, b) for a, b in zip(whole, got)), "a resumed rollout differs from one request"
    rollout = store.get("s", "world")
    assert rollout.chunks == 3 and rollout.cache.frames == 6 and rollout.cache.tokens() == 3 * 6  # window: 3
    assert not engine.rollouts and not engine.cameras
    store.drop("s")
    assert not store.sessions and len(store) == 0


def test_resume_takes_the_new_prompt_and_a_fresh_start_ignores_the_store():
    engine, store = make_engine(), SessionStore()
    run_request(engine, "a", 1, session=SessionHandle(store, "s", "world", resume=False))
    kept = run_request(engine, "b", 1, first=2, session=SessionHandle(store, "s", "world", resume=True))
    engine, store = make_engine(), SessionStore()
    run_request(engine, "a", 1, session=SessionHandle(store, "s", "world", resume=False))
    other = run_request(engine, "b", 1, first=2, session=SessionHandle(store, "s", "world", resume=True), text_seed=6)
    assert not torch.equal(kept[0], other[0])  # the resumed request's prompt conditions its own chunks
    fresh = run_request(engine, "c", 1, session=SessionHandle(store, "s", "world", resume=False))
    assert torch.equal(fresh[0], run_request(make_engine(), "d", 1)[0])  # a fresh start does not read the store


def test_a_resume_without_poses_keeps_the_camera_still():
    engine, store = make_engine(), SessionStore()
    run_request(engine, "a", 1, session=SessionHandle(store, "s", "world", resume=False))
    resumed = item("b", 0, 1, first=2, session=SessionHandle(store, "s", "world", resume=True), camera_given=False)
    resumed.inputs["camera"] = torch.eye(4, dtype=torch.float64).repeat(2, 1, 1)  # as the frontend fills it
    engine.run([resumed])
    assert torch.equal(engine.cameras["b"], torch.eye(4).repeat(2, 1, 1))  # no step from where it stopped
    assert torch.equal(store.get("s", "world").extra["pose"], trajectory(2)[1])


def test_resume_without_state_fails():
    with pytest.raises(RuntimeError, match="gone"):
        make_engine().run([item("a", 0, 1, session=SessionHandle(SessionStore(), "gone", "world", resume=True))])
