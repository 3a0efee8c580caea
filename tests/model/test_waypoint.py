"""Waypoint's invariants (no pip reference exists to compare against): the frame windows equal
the reference's ring-buffer bookkeeping, frame-by-frame generation over the KV cache equals one
teacher-forced pass with the equivalent mask, no frame depends on later frames or controls,
TAEHV's frame-by-frame encode and decode equal the whole-video ones, and a seed fixes a rollout.
Tiny random configs, float32, CPU."""

from __future__ import annotations

import pytest
import torch

from mstar.model.waypoint.dit import FrameKV, WorldDiT, frame_visible
from mstar.model.waypoint.rollout import WaypointWorld
from mstar.model.waypoint.taehv import TAEHV, StreamingDecoder, TimeStream
from tests.support.waypoint import randomize, tiny_dit_config, tiny_taehv_config

TOL = 1e-5


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.fixture(scope="module")
def dit() -> WorldDiT:
    return randomize(WorldDiT(tiny_dit_config()), 0)


@pytest.fixture(scope="module")
def tae() -> TAEHV:
    return randomize(TAEHV(tiny_taehv_config()), 1)


def ring_views(frames: int, slots: int, dilation: int):
    """The reference's KV ring, step by step: frame t maps to slot ceil(t / d) mod slots, the
    slot it is about to overwrite is hidden from it, and only every d-th frame is written."""
    ring: dict[int, int] = {}
    for t in range(frames):
        slot = ((t + dilation - 1) // dilation) % slots
        writes = t % dilation == 0
        yield t, {f for s, f in ring.items() if not (writes and s == slot)}
        if writes:
            ring[slot] = t


@pytest.mark.parametrize("slots, dilation", [(1, 1), (2, 1), (4, 1), (4, 2), (3, 4), (8, 3)])
def test_frame_windows_match_the_reference_ring(slots: int, dilation: int) -> None:
    for t, seen in ring_views(60, slots, dilation):
        assert seen == {f for f in range(t) if frame_visible(t, f, slots, dilation)}, (t, seen)


def clean_pass_frames(dit: WorldDiT, x, control, first=0):
    """Frame by frame over a cache, each frame's clean pass writing its keys and values."""
    kv = FrameKV(dit.config)
    zero = torch.zeros(1, 1)
    outs = [dit(x[:, t:t + 1], zero, t + first, control[:, t:t + 1], kv, persist=True) for t in range(x.shape[1])]
    return torch.cat(outs, 1), kv


def test_frame_by_frame_equals_teacher_forced(dit: WorldDiT) -> None:
    c = dit.config
    gen = torch.Generator().manual_seed(2)
    n = 11  # past both windows (local 2 frames, global 4 slots of every 2nd frame)
    x = torch.randn(1, n, c.channels, 2, 4, generator=gen)
    control = torch.randn(1, n, c.control_dim, generator=gen)
    stepped, kv = clean_pass_frames(dit, x, control)
    whole = dit(x, torch.zeros(1, n), 0, control)
    assert close(stepped, whole)
    # a noisy next frame over the cache == the last frame of one pass over [clean past, noisy]
    z = torch.randn(1, 1, c.channels, 2, 4, generator=gen)
    zc = torch.randn(1, 1, c.control_dim, generator=gen)
    cached = dit(z, torch.full((1, 1), 0.6), n, zc, kv)
    sigma = torch.cat((torch.zeros(1, n), torch.full((1, 1), 0.6)), 1)
    forced = dit(torch.cat((x, z), 1), sigma, 0, torch.cat((control, zc), 1))[:, -1:]
    assert close(cached, forced)
    assert (cached - stepped[:, -1:]).abs().max() > 1e-3  # not a constant
    # the cache keeps only what a later frame can see
    for layer, (slots, dilation) in enumerate(kv.windows):
        assert sorted(kv.layers[layer]) == [f for f in range(n) if frame_visible(n, f, slots, dilation)]


def test_a_frame_never_depends_on_later_frames_or_controls(dit: WorldDiT) -> None:
    c = dit.config
    gen = torch.Generator().manual_seed(3)
    n, t = 6, 3
    x = torch.randn(1, n, c.channels, 2, 4, generator=gen)
    control = torch.randn(1, n, c.control_dim, generator=gen)
    sigma = torch.rand(1, n, generator=gen)
    base = dit(x, sigma, 0, control)
    later_x, later_c = x.clone(), control.clone()
    later_x[:, t + 1:] += 1.0
    later_c[:, t + 1:] = torch.randn(1, n - t - 1, c.control_dim, generator=gen)
    changed = dit(later_x, sigma, 0, later_c)
    assert torch.equal(changed[:, :t + 1], base[:, :t + 1])
    assert (changed[:, t + 1:] - base[:, t + 1:]).abs().max() > 1e-3
    own = control.clone()
    own[:, t] += 1.0  # a frame's own control moves it, and the frames after it
    moved = dit(x, sigma, 0, own)
    assert torch.equal(moved[:, :t], base[:, :t])
    assert (moved[:, t] - base[:, t]).abs().max() > 1e-3


def test_taehv_shapes_and_streaming_equal_whole(tae: TAEHV) -> None:
    gen = torch.Generator().manual_seed(4)
    video = torch.rand(2, 8, 3, 16, 32, generator=gen)
    latents = tae.encode_whole(video)
    assert latents.shape == (2, 2, 4, 2, 4)
    stream = TimeStream(tae.encoder)
    pieces = [stream.push(tae.pixels_in(video[:, i:i + 1])) for i in range(8)]
    assert [p is None for p in pieces] == [True, True, True, False] * 2
    assert close(torch.cat([p for p in pieces if p is not None], 1), latents)

    z = torch.randn(2, 5, 4, 2, 4, generator=gen)
    whole = tae.decode_whole(z)
    assert whole.shape == (2, 5 * 4 - 3, 3, 16, 32)
    stream = TimeStream(tae.decoder)
    raw = torch.cat([stream.push(z[:, i:i + 1]) for i in range(5)], 1)
    assert close(tae.from_decoder(raw)[:, 3:], whole)
    assert whole.min() >= 0 and whole.max() <= 1 and whole.std() > 1e-3


def test_streaming_decoder_primes_with_the_first_latent(tae: TAEHV) -> None:
    """The world-model decode: the first latent is fed time_upscale times, only the last pass's
    frames kept; then four frames per latent. == the whole decode of the primed sequence."""
    z = torch.randn(1, 3, 4, 2, 4, generator=torch.Generator().manual_seed(8))
    decoder = StreamingDecoder(tae)
    frames = [decoder.push(z[:, i:i + 1]) for i in range(3)]
    assert [f.shape[1] for f in frames] == [4, 4, 4]
    primed = torch.cat((z[:, :1].expand(-1, 3, -1, -1, -1), z), 1)
    assert close(torch.cat(frames, 1), tae.decode_whole(primed)[:, 9:])


def test_a_single_image_encodes_to_one_latent(tae: TAEHV) -> None:
    image = torch.rand(1, 1, 3, 16, 32, generator=torch.Generator().manual_seed(5))
    latent = tae.encode_whole(image)
    assert latent.shape == (1, 1, 4, 2, 4)
    assert close(latent, tae.encode_whole(image.expand(-1, 4, -1, -1, -1)))  # padded with copies of itself


def control_rows(n: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def rollout_frames(world: WaypointWorld, seed: int, controls: torch.Tensor, pixels: torch.Tensor):
    rollout = world.new_rollout(seed)
    world.start(rollout, pixels)
    return [world.step(rollout, row) for row in controls], rollout


def test_rollout_is_seeded_and_causal(dit: WorldDiT, tae: TAEHV) -> None:
    world = WaypointWorld(dit, tae, torch.device("cpu"))
    assert world.pixel_size == (16, 32)
    pixels = torch.rand(3, 16, 32, generator=torch.Generator().manual_seed(6))
    controls = control_rows(5, dit.config.control_dim, 7)
    a, rollout = rollout_frames(world, 11, controls, pixels)
    b, _ = rollout_frames(world, 11, controls, pixels)
    c, _ = rollout_frames(world, 12, controls, pixels)
    assert all(f.shape == (4, 16, 32, 3) and f.dtype == torch.uint8 for f in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert any(not torch.equal(x, y) for x, y in zip(a, c))
    assert rollout.frame == 6 and rollout.latent.shape == (1, 4, 2, 4)
    other = controls.clone()
    other[3:] = control_rows(2, dit.config.control_dim, 8)  # the same until step 3
    d, _ = rollout_frames(world, 11, other, pixels)
    assert all(torch.equal(x, y) for x, y in zip(a[:3], d[:3]))
    assert any(not torch.equal(x, y) for x, y in zip(a[3:], d[3:]))


def test_rollout_equals_the_sampler_written_out(dit: WorldDiT, tae: TAEHV) -> None:
    """The rollout's latents == Euler over the sigmas on a teacher-forced pass of the whole
    prefix (no cache), frame after frame, from the same noise."""
    world = WaypointWorld(dit, tae, torch.device("cpu"))
    pixels = torch.rand(3, 16, 32, generator=torch.Generator().manual_seed(9))
    controls = control_rows(3, dit.config.control_dim, 10)
    rollout = world.new_rollout(4)
    seed_latent = world.start(rollout, pixels)
    got = [world.generate_latent(rollout, row) for row in controls]

    noise = torch.Generator().manual_seed(4)
    past, past_c = seed_latent[:, None], torch.zeros(1, 1, dit.config.control_dim)
    sigmas = dit.config.scheduler_sigmas
    for row, latent in zip(controls, got):
        x = torch.randn((1, 1, *world.latent_shape), generator=noise)
        ctrl = torch.cat((past_c, row.view(1, 1, -1)), 1)
        for s, s_next in zip(sigmas, sigmas[1:]):
            sigma = torch.cat((torch.zeros(1, past.shape[1]), torch.full((1, 1), s)), 1)
            x = x + (s_next - s) * dit(torch.cat((past, x), 1), sigma, 0, ctrl)[:, -1:]
        assert close(latent, x[:, 0])
        past, past_c = torch.cat((past, x), 1), ctrl


def test_frames_are_resized_to_the_display_size(dit: WorldDiT, tae: TAEHV, monkeypatch) -> None:
    """The released 16:8 autoencoder sizes are shown at 16:9 (bilinear), as the reference does;
    here the tiny model's 16x32 stands in for one of them."""
    from mstar.model.waypoint import rollout as module

    monkeypatch.setattr(module, "DISPLAY_SIZES", {(16, 32): (18, 32)})
    world = WaypointWorld(dit, tae, torch.device("cpu"))
    state = world.new_rollout(0)
    world.start(state, torch.rand(3, 16, 32, generator=torch.Generator().manual_seed(1)))
    assert world.step(state, torch.zeros(dit.config.control_dim)).shape == (4, 18, 32, 3)


def test_the_default_config_is_waypoint_1_5_1b_sized() -> None:
    """The 1.5 defaults (Overworld's quark engine's numbers) with the conditioning projections
    tied across blocks make the model card's 1.28B parameters; global layers 3, 7, ..., 23."""
    from mstar.model.waypoint.config import WaypointConfig

    config = WaypointConfig()
    with torch.device("meta"):
        model = WorldDiT(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 1.28
    assert [i for i in range(config.n_layers) if config.is_global(i)] == [3, 7, 11, 15, 19, 23]
    assert config.window(3) == (16, 8) and config.window(0) == (16, 1)


def test_engine_resumes_a_session_rollout(dit: WorldDiT, tae: TAEHV) -> None:
    """The engine keeps a session's rollout in the store: 2 steps, then a resumed request's 3
    (no start) equal one request of 5, bit for bit; release leaves only the store's copy."""
    from mstar.engine.base import EngineItem
    from mstar.model.waypoint.engine import FRAME, START, WaypointEngine
    from mstar.runtime.sessions import SessionHandle, SessionStore

    world = WaypointWorld(dit, tae, torch.device("cpu"))
    pixels = torch.rand(3, 16, 32, generator=torch.Generator().manual_seed(6))
    controls = control_rows(5, dit.config.control_dim, 7)
    whole, _ = rollout_frames(world, 11, controls, pixels)

    engine, store = WaypointEngine(world), SessionStore()

    def request(rid: str, rows: torch.Tensor, resume: bool) -> list[torch.Tensor]:
        session = SessionHandle(store, "s", "world", resume)
        if not resume:
            engine.run([EngineItem(rid, START, 0, {"pixels": pixels}, {"seed": 11}, session=session)])
        out = [engine.run([EngineItem(rid, FRAME, i, {"controls": rows}, {}, session=session)])[0].outputs["frames"]
               for i in range(len(rows))]
        engine.release(rid)
        return out

    got = request("a", controls[:2], False) + request("b", controls[2:], True)
    assert all(torch.equal(x, y) for x, y in zip(whole, got)) and len(got) == 5
    assert engine.rollouts == {} and store.get("s", "world").frame == 6
    store.drop("s")
    with pytest.raises(RuntimeError, match="no waypoint rollout"):
        request("c", controls[:1], True)
