"""Cosmos3 chained windowed rollouts through the in-process runtime on the tiny random checkpoint
(``enable_windowed_video``): a 3-window rollout equals running our own t2v and v2v paths window
by window by hand (engine items on freshly built engines: window 0 as t2v; each later window a
v2v request whose clip is the previous window's last frames, on the next noise draw of the
seed's generator), every step's latents within 1e-5 relative and the delivered frames exactly;
the schedule is padded to whole windows and trimmed to ``num_frames``; seeded requests repeat;
``stream_video`` sends one event a window; the windowed knobs' 400s name the field."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError, SessionSpec
from mstar.engine.base import EngineItem
from mstar.model.cosmos3.conditioning import video_pixels
from mstar.model.cosmos3.model import Cosmos3
from mstar.model.cosmos3.windowed import plan_windows
from mstar.runtime.launch import start
from tests.support.cosmos3_media import step_latents
from tests.support.cosmos3_windows import (
    GUIDANCE,
    HEIGHT,
    PROMPT,
    STEPS,
    WIDTH,
    run_together,
)
from tests.support.cosmos3_windows import video_chunks as events
from tests.support.cosmos3_windows import windowed_config as config
from tests.support.packing import held_until

pytest.importorskip("diffusers")

# windows of 9 frames (3 latent), 2 pinned latent frames (5 pixel frames): 9 + 4 + 4 = 17
WINDOW = {"window_mode": "chained", "window_frames": 9, "overlap_frames": 5}


@pytest.fixture(scope="module")
def deployment(checkpoint):
    d = start(config(checkpoint), in_process=True)
    yield d
    d.close()


def as_frames(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, HEIGHT, WIDTH, 3)


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


class ByHand:
    """Our t2v and v2v paths driven item by item on engines of their own."""

    def __init__(self, checkpoint):
        self.spec = Cosmos3(config(checkpoint))
        self.spec.load_frontend()
        engines = self.spec.build_engines({"dit", "vae"}, torch.device("cpu"))
        self.dit, self.vae = engines["dit"], engines["vae"]
        self.count = 0

    def window(self, noise, frames: int, clip: np.ndarray | None, k: int) -> tuple[list[torch.Tensor], np.ndarray]:
        """One clip of ``frames`` from ``noise``: t2v, or v2v on ``clip``'s first ``k`` latent
        frames. Every step's latents and the decoded uint8 frames."""
        self.count += 1
        rid = f"hand{self.count}"
        meta = dict(num_frames=frames, height=HEIGHT, width=WIDTH, fps=24.0)
        inputs = {"latents": noise, "prompt_ids": self.spec.prompt.ids(PROMPT, **meta),
                  "negative_ids": self.spec.prompt.ids("", negative=True, **meta)}
        if clip is not None:
            pixels = video_pixels(clip, WIDTH, HEIGHT, k)
            [enc] = self.vae.run([EngineItem(rid, "encode", 0, {"cond_pixels": pixels}, {})])
            inputs["cond_latents"] = enc.outputs["cond_latents"]
        params = {"num_steps": STEPS, "guidance_scale": GUIDANCE, "fps": 24.0, "num_frames": frames}
        steps = []
        for i in range(STEPS):
            [out] = self.dit.run([EngineItem(rid, "step", i, dict(inputs), params)])
            inputs["latents"] = out.outputs["latents"]
            steps.append(inputs["latents"])
        self.dit.release(rid)
        [dec] = self.vae.run([EngineItem(rid, "decode", 0, {"latents": inputs["latents"]}, {})])
        return steps, dec.outputs["frames"].numpy()

    def rollout(self, seed: int, windows: int, tail: np.ndarray | None = None):
        generator = torch.Generator().manual_seed(seed)
        noises = [torch.randn((4, 3, HEIGHT // 16, WIDTH // 16), generator=generator) for _ in range(windows)]
        steps, delivered = [], []
        for noise in noises:
            got, frames = self.window(noise, 9, tail, 2)
            steps += got
            delivered.append(frames if tail is None else frames[5:])
            tail = frames[-5:]
        return steps, delivered


@pytest.fixture(scope="module")
def by_hand(checkpoint):
    return ByHand(checkpoint)


def test_plan_pads_to_whole_windows():
    plan = plan_windows(17, 9, 5, resume=False)
    assert (plan.num_windows, plan.pinned_latents, plan.pinned_frames) == (3, 2, 5)
    assert [plan.delivered(w) for w in range(3)] == [(0, 9), (5, 4), (5, 4)]
    plan = plan_windows(13, 10, 5, resume=False)  # 10 frames quantize down to 9
    assert plan.window_frames == 9 and [plan.delivered(w) for w in range(plan.num_windows)] == [(0, 9), (5, 4)]
    plan = plan_windows(21, 9, 5, resume=False)  # padded to a whole window, the last one trimmed
    assert plan.num_windows == 4 and plan.delivered(3) == (5, 4)
    plan = plan_windows(19, 9, 5, resume=False)
    assert plan.num_windows == 4 and plan.delivered(3) == (5, 2)
    plan = plan_windows(5, 9, 5, resume=True)  # a resumed session: window 0 delivers its 4 new frames
    assert plan.num_windows == 2 and [plan.delivered(w) for w in range(2)] == [(5, 4), (5, 1)]
    assert plan_windows(241, 61, 32, resume=False).pinned_frames == 29  # Edge's defaults
    assert plan_windows(241, 29, 8, resume=False).pinned_frames == 5


def test_three_windows_equal_the_window_by_window_paths(deployment, by_hand):
    with step_latents(deployment) as seen:
        [clip] = events(deployment, "win3", num_frames=17, seed=7, **WINDOW)
    want, delivered = by_hand.rollout(7, 3)
    assert len(seen) == len(want) == 3 * STEPS
    for i, (got, ref) in enumerate(zip(seen, want)):
        err = rel(got, ref)
        print(f"[parity] window {i // STEPS} step {i % STEPS}: latents rel err {err:.2e}")
        assert err <= 1e-5
    ours, ref = as_frames(clip), np.concatenate(delivered)
    assert ours.shape == (17, HEIGHT, WIDTH, 3)
    diff = int(np.abs(ours.astype(np.int16) - ref.astype(np.int16)).max())
    print(f"[parity] delivered frames max level diff {diff}")
    assert diff == 0


def test_seeded_rollouts_repeat_and_stream_one_event_a_window(deployment):
    whole = events(deployment, "seed-a", num_frames=13, seed=3, **WINDOW)
    again = events(deployment, "seed-b", num_frames=13, seed=3, **WINDOW)
    other = events(deployment, "seed-c", num_frames=13, seed=4, **WINDOW)
    streamed = events(deployment, "seed-d", num_frames=13, seed=3, stream_video=True, **WINDOW)
    assert len(whole) == 1 and whole == again and other != whole
    assert [len(as_frames(chunk)) for chunk in streamed] == [9, 4]
    assert b"".join(streamed) == whole[0]
    # a plain t2v request of one window's length is window 0 (the same first noise draw)
    [plain] = events(deployment, "seed-e", num_frames=9, seed=3)
    assert plain == whole[0][:len(plain)]


def test_i2v_window_zero_is_the_image_conditioned_clip(deployment):
    from test_cosmos3_conditioned import picture, png  # noqa: PLC0415

    files = [("image.png", png(picture(40, 30, 1)))]
    [plain] = events(deployment, "i2v-plain", files, num_frames=9, seed=5)
    chunks = events(deployment, "i2v-win", files, num_frames=13, seed=5, stream_video=True,
                    window_frames=9, overlap_frames=5)
    assert chunks[0] == plain and len(as_frames(chunks[1])) == 4


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"window_mode": "sliding"}, "window_mode"),
    ({"window_mode": "chained", "window_frames": 5}, "window_frames"),
    ({"window_mode": "chained", "window_frames": 9, "overlap_frames": 9}, "overlap_frames"),
    ({"window_mode": "chained", "context_frames": 61}, "context_frames"),
    ({"stream_video": True, "enable_sound": True}, "enable_sound"),
    ({"stream_video": True, "window_frames": 13 * 4 + 1}, "window_frames"),  # over max_video_pixels
    ({"window_frames": 9}, "window_frames"),  # a windowed knob on a plain request
])
def test_bad_windowed_requests_name_the_field(deployment, kwargs, field):
    spec = GenerateSpec("bad", PROMPT, [], ["video"], {"height": HEIGHT, "width": WIDTH, "num_frames": 17, **kwargs})
    with pytest.raises(RequestError) as err:
        deployment.spec.prepare_generate(spec)
    assert err.value.field == field, err.value


def test_windowed_requests_need_the_deployment_knob(checkpoint):
    spec = Cosmos3(parse_config({"model": "cosmos3", "model_path": str(checkpoint.root)}))
    spec.load_frontend()
    assert not any(name.startswith("windowed") for name in spec.graph().walks)
    with pytest.raises(RequestError) as err:
        spec.prepare_generate(GenerateSpec("off", PROMPT, [], ["video"],
                                           {"height": HEIGHT, "width": WIDTH, "num_frames": 17,
                                            "window_mode": "chained"}))
    assert err.value.field == "window_mode"


def session_events(d, request_id, session, **kwargs) -> list[bytes]:
    return events(d, request_id, session=session, **WINDOW, **kwargs)


def test_a_resumed_session_continues_from_its_last_frames(deployment):
    """Opening (2 windows) + resume (3 windows) equals one rollout of 5 windows with the opening's
    seed: the resume is conditioned on the kept window's tail, as a later window is, and draws
    its noise from the session's stream (the resume's own seed is not used)."""
    worker = deployment.runtime.workers.workers[0]
    [first] = session_events(deployment, "sess-a", SessionSpec("world"), num_frames=13, seed=3)
    kept = worker.sessions.get("world", "vae")
    # the last window whole: its 5 pinned frames (decoded again) and its 4 new ones, the clip's last
    assert kept is not None and kept.frames.shape == (9, HEIGHT, WIDTH, 3)
    assert np.array_equal(kept.frames.numpy()[5:], as_frames(first)[-4:])
    [rest] = session_events(deployment, "sess-b", SessionSpec("world", resume=True, end=True), num_frames=9, seed=11)
    assert as_frames(rest).shape == (9, HEIGHT, WIDTH, 3)  # only the new frames
    [whole] = events(deployment, "sess-whole", num_frames=25, seed=3, **WINDOW)  # 9 + 4 x 4 frames
    ours, ref = np.concatenate([as_frames(first), as_frames(rest)]), as_frames(whole)[:22]
    diff = int(np.abs(ours.astype(np.int16) - ref.astype(np.int16)).max())
    print(f"[parity] opening + resume vs one rollout: frames max level diff {diff}")
    assert diff == 0
    deadline = time.monotonic() + 10
    while worker.sessions.get("world", "vae") is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.sessions.get("world", "vae") is None  # end_session freed it


def test_a_resumed_session_takes_no_file(deployment):
    from test_cosmos3_conditioned import picture, png  # noqa: PLC0415

    spec = GenerateSpec("resume-file", PROMPT, [("image.png", png(picture(40, 30, 1)))], ["video"],
                        {"height": HEIGHT, "width": WIDTH, "num_frames": 9, **WINDOW},
                        session=SessionSpec("x", resume=True))
    with pytest.raises(RequestError) as err:
        deployment.spec.prepare_generate(spec)
    assert err.value.field == "image"


def test_windowed_and_plain_requests_share_forwards(deployment):
    dit = deployment.runtime.workers.workers[0].engines["dit"]
    jobs = [("w1", {"num_frames": 13, "seed": 1, **WINDOW}), ("w2", {"num_frames": 17, "seed": 2, **WINDOW}),
            ("p", {"num_frames": 9, "seed": 3})]
    alone = {rid: b"".join(events(deployment, f"solo-{rid}", **kw)) for rid, kw in jobs}
    dit.forward_rows.clear()
    with held_until(dit, 2):
        batched = run_together(deployment, jobs)
    assert sum(dit.forward_rows) == (2 + 3 + 1) * STEPS * 2  # windows x steps x the guided pair
    assert max(dit.forward_rows) > 2  # windows of different requests (and the plain clip) packed
    for (rid, _), got in zip(jobs, batched):
        diff = int(np.abs(as_frames(got).astype(np.int16) - as_frames(alone[rid]).astype(np.int16)).max())
        print(f"[parity] {rid} packed vs solo: {diff} levels")
        assert diff <= 2  # the packed GEMMs round differently (1e-7); a window tail re-encodes the rounding
    assert not dit.prepared and not dit.solvers and not dit.schedules  # per-request state released
