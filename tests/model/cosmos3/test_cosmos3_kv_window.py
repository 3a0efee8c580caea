"""Cosmos3 ``window_mode: kv`` rollouts on the tiny random checkpoint (fp32, CPU).

(a) Every step of a guided kv rollout, driven on our denoise engine, equals one forward of the
whole sequence in diffusers 0.42.1's ``Cosmos3OmniTransformer`` (fed by the pipeline's packing
helpers): [text, the earlier windows' finished latents as clean frames, this window's noisy
latents], its generation-pathway attention masked block-causally by a processor written here
(a media row sees the text, its own window and the earlier windows' frames at most
``context`` latent frames before its window's first). With ``context_frames`` 0 every earlier
frame is read; with 9 (3 latent frames, less than two windows of 2) the older ones are released
mid-window and the committed cache stays at 3 frames; window 0 conditioned on an image's
latent frame too. (b) A one-window kv rollout is the plain t2v (or i2v) clip. (c) The windows
decode as one latent video: the VAE's causal state is carried from window to window, so the
frames delivered window by window (5, then 8 a window of 2 latent frames) are the decode of
the rollout's latents at once, bit for bit; a batch of decodes that fails leaves every carried
state as it found it. (d) Seeded kv rollouts through the in-process runtime repeat, stream one
event a window and equal the engine-driven rollout step for step; packed with other requests
they equal their solo runs; a kv session keeps its last window, which a chained request
resumes, and a kv resume goes on with the decode too. The startup warning; the 400s."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mstar.contract import GenerateSpec, RequestError, SessionSpec
from mstar.engine.base import EngineItem
from mstar.model.cosmos3.kv_window import context_latents
from mstar.model.cosmos3.model import Cosmos3
from mstar.model.cosmos3.windowed import WindowPlan, plan_kv_windows, window_noise
from mstar.model.wan22.vae import frames_uint8
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

LATENT = 2  # latent frames a window: window_frames 5
KV = {"window_mode": "kv", "window_frames": 5}


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


class Rollout:
    """A kv rollout driven item by item on a denoise engine of its own; every tower row it ran."""

    def __init__(self, checkpoint):
        self.spec = Cosmos3(config(checkpoint))
        self.spec.load_frontend()
        self.dit = self.spec.build_engines({"dit"}, torch.device("cpu"))["dit"]
        self.rows: list[tuple] = []  # (MediaItem, Prediction) of denoise rows, commit rows left out
        original = self.dit.tower.predict

        def predict(items):
            out = original(items)
            self.rows += [(i, p) for i, p in zip(items, out) if i.keep is None]
            return out

        self.dit.tower.predict = predict

    def ids(self):
        meta = dict(num_frames=5, height=HEIGHT, width=WIDTH, fps=24.0)
        return self.spec.prompt.ids(PROMPT, **meta), self.spec.prompt.ids("", negative=True, **meta)

    def run(self, rid: str, seed: int, windows: int, context_frames: int, first: torch.Tensor | None = None):
        """Every window's final latents, and the held frames of the committed cache after each
        commit. ``first``: window 0's conditioning latents (an image's one frame)."""
        prompt, negative = self.ids()
        noise = window_noise((4, LATENT, HEIGHT // 16, WIDTH // 16), windows, seed)
        params = {"num_steps": STEPS, "guidance_scale": GUIDANCE, "fps": 24.0, "window_mode": "kv",
                  "num_windows": windows, "context_latents": context_latents(context_frames)}
        finals, held = [], []
        for w in range(windows):
            inputs = {"latents": noise[w], "prompt_ids": prompt, "negative_ids": negative,
                      "cond_latents": first if w == 0 and first is not None else noise[w][:, :0]}
            for i in range(STEPS):
                [out] = self.dit.run([EngineItem(rid, "step", i, dict(inputs), params)])
                inputs["latents"] = out.outputs["latents"]
            finals.append(inputs["latents"])
            kv = self.dit.committed[rid]
            held.append((kv.frames, [k.shape[0] for k, _ in kv.past(0) or []]))
        self.dit.release(rid)
        return finals, held


class BlockCausal:
    """diffusers' Cosmos3 attention with the generation pathway masked by ``mask [gen, und + gen]``."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def __call__(self, attn, und_seq, gen_seq, rotary_emb):
        def heads(x, n):
            return x.view(-1, n, attn.head_dim)

        def rope(x, cos, sin):
            half = x.shape[-1] // 2
            return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]

        cos_und, sin_und, cos_gen, sin_gen = rotary_emb
        q_und = attn.norm_q(heads(attn.to_q(und_seq), attn.num_attention_heads))
        k_und = attn.norm_k(heads(attn.to_k(und_seq), attn.num_key_value_heads))
        k_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        v_und = heads(attn.to_v(und_seq), attn.num_key_value_heads)
        q_gen = rope(attn.norm_added_q(heads(attn.add_q_proj(gen_seq), attn.num_attention_heads)), cos_gen, sin_gen)
        k_gen = rope(attn.norm_added_k(heads(attn.add_k_proj(gen_seq), attn.num_key_value_heads)), cos_gen, sin_gen)
        v_gen = heads(attn.add_v_proj(gen_seq), attn.num_key_value_heads)
        q_und, k_und, k_for_gen = (rope(x, cos_und, sin_und) for x in (q_und, k_und, k_for_gen))
        und = F.scaled_dot_product_attention(q_und.transpose(0, 1), k_und.transpose(0, 1), v_und.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        keys, values = torch.cat([k_for_gen, k_gen]), torch.cat([v_und, v_gen])
        gen = F.scaled_dot_product_attention(q_gen.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=self.mask, enable_gqa=True)
        return attn.to_out(und.transpose(0, 1).flatten(-2)), attn.to_add_out(gen.transpose(0, 1).flatten(-2))


def block_causal_mask(text: int, frames: int, per_frame: int, context: int) -> torch.Tensor:
    """Query rows of latent frame ``f`` (window ``f // LATENT``) see the text, their window's
    frames, and earlier windows' frames ``g`` with ``g >= first(f) - context`` (all when 0)."""
    f = torch.arange(frames).repeat_interleave(per_frame)
    first = f // LATENT * LATENT
    same = (f[:, None] // LATENT) == (f[None, :] // LATENT)
    earlier = f[None, :] < first[:, None]
    if context:
        earlier &= f[None, :] >= first[:, None] - context
    return torch.cat([torch.ones(len(f), text, dtype=torch.bool), same | earlier], dim=1)


def reference(tower, ids, clean: list[torch.Tensor], noisy: torch.Tensor, timestep: float, context: int,
              pinned: int = 0):
    """diffusers' velocity of the noisy window (its first ``pinned`` frames clean) at the end of
    the whole sequence."""
    from diffusers import Cosmos3OmniPipeline

    latents = torch.cat([*clean, noisy], dim=1)
    frames = latents.shape[1]
    host = SimpleNamespace(transformer=tower, vae_scale_factor_temporal=4)
    text = Cosmos3OmniPipeline._prepare_text_segment(host, ids.tolist(), device="cpu")
    conditions = list(range(frames - noisy.shape[1] + pinned))
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        host, latents[None], has_image_condition=bool(conditions), mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=24.0, curr=text["und_len"], device="cpu", condition_frame_indexes=conditions)
    per_frame = vision["num_vision_tokens"] // frames
    mask = block_causal_mask(text["und_len"], frames, per_frame, context)
    for layer in tower.layers:
        layer.self_attn.processor = BlockCausal(mask)
    out = tower(input_ids=text["input_ids"], text_indexes=text["text_indexes"],
                position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
                und_len=text["und_len"], sequence_length=text["und_len"] + vision["num_vision_tokens"],
                vision_tokens=[latents[None]], vision_token_shapes=vision["vision_token_shapes"],
                vision_sequence_indexes=vision["vision_sequence_indexes"],
                vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
                vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), float(timestep)),
                vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"], return_dict=False)
    velocity = out[0][0][0][:, -noisy.shape[1]:]
    velocity[:, :pinned] = 0  # ours zeroes a clean frame's velocity
    return velocity


@pytest.mark.parametrize(("context_frames", "windows", "held", "image"),
                         [(0, 3, [2, 4, 4], False), (9, 4, [2, 3, 3, 3], False), (0, 2, [2, 2], True)],
                         ids=["keep_all", "context_9", "image_conditioned"])
def test_every_window_equals_the_block_causal_sequence(checkpoint, context_frames, windows, held, image):
    rollout = Rollout(checkpoint)
    first = torch.randn((4, 1, HEIGHT // 16, WIDTH // 16), generator=torch.Generator().manual_seed(9)) if image \
        else None
    finals, kept = rollout.run("kv", 5, windows, context_frames, first)
    # the last window commits nothing; the cache stays bounded at context_frames' 3 latent frames
    per_frame = 2  # a 3x2 latent frame padded to 4x2: 2x1 patches
    assert [frames for frames, _ in kept] == held
    assert all(lengths == [frames * per_frame] * 2 for frames, lengths in kept if frames)
    tower = copy.deepcopy(checkpoint.transformer)
    prompt, negative = rollout.ids()
    context = context_latents(context_frames)
    assert len(rollout.rows) == windows * STEPS * 2  # a guided pair a step
    worst = 0.0
    with torch.no_grad():
        for n, (item, prediction) in enumerate(rollout.rows):
            window, ids = n // (2 * STEPS), (prompt, negative)[n % 2]
            pinned = 1 if image and window == 0 else 0
            assert item.noisy == list(range(pinned, LATENT))
            want = reference(tower, ids, finals[:window], item.latents, item.timestep, context, pinned)
            err = rel(prediction.video, want)
            worst = max(worst, err)
            assert err <= 1e-5, (n, err)
    tag = f"context {context_frames}" + (" image" if image else "")
    print(f"[parity] kv {tag}: {len(rollout.rows)} rows, worst velocity rel err {worst:.1e}")


def test_the_context_releases_frames(checkpoint):
    # a masked reference that reads every earlier frame differs once frames were released
    rollout = Rollout(checkpoint)
    finals, _ = rollout.run("kv", 5, 3, 5)  # context 5 frames: 2 latent frames, window 2 reads window 1 only
    item, prediction = rollout.rows[-2]
    prompt, _ = rollout.ids()
    tower = copy.deepcopy(checkpoint.transformer)
    with torch.no_grad():
        bounded = reference(tower, prompt, finals[:2], item.latents, item.timestep, 2)
        everything = reference(tower, prompt, finals[:2], item.latents, item.timestep, 0)
    assert rel(prediction.video, bounded) <= 1e-5
    assert rel(prediction.video, everything) > 1e-3


@pytest.fixture(scope="module")
def deployment(checkpoint):
    d = start(config(checkpoint), in_process=True)
    yield d
    d.close()


def test_one_kv_window_is_the_plain_clip(deployment):
    from test_cosmos3_conditioned import picture, png  # noqa: PLC0415

    [plain] = events(deployment, "plain", num_frames=5, seed=3)
    [window] = events(deployment, "one", num_frames=5, seed=3, **KV)
    assert window == plain
    files = [("image.png", png(picture(40, 30, 1)))]
    [plain] = events(deployment, "i2v-plain", files, num_frames=5, seed=4)
    chunks = events(deployment, "i2v-kv", files, num_frames=9, seed=4, stream_video=True, **KV)
    assert chunks[0] == plain and len(chunks[1]) == 4 * HEIGHT * WIDTH * 3  # window 0 is the i2v clip


def test_kv_plans_count_the_carried_decodes_frames():
    """Window 0 gives 1 + 4 (L - 1) frames, every later window (a resume's first too) 4 L; the
    schedule is padded to whole windows and the last one trimmed."""
    def delivered(plan):
        return [plan.delivered(w) for w in range(plan.num_windows)]

    assert delivered(plan_kv_windows(13, 5)) == [(0, 5), (0, 8)]
    assert delivered(plan_kv_windows(18, 5)) == [(0, 5), (0, 8), (0, 5)]
    assert delivered(plan_kv_windows(3, 5)) == [(0, 3)]
    assert delivered(plan_kv_windows(16, 5, resume=True)) == [(0, 8), (0, 8)]
    assert delivered(plan_kv_windows(9, 5, resume=True)) == [(0, 8), (0, 1)]
    plan = plan_kv_windows(93, 29)  # the defaults: 8 latent frames a window, 24 in all, as one 93-frame clip
    assert (plan.num_windows, [plan.new_frames(w) for w in range(3)]) == (3, [29, 32, 32])
    assert WindowPlan.of_params(plan.params()) == plan
    resumed = plan_kv_windows(64, 29, resume=True)
    assert WindowPlan.of_params(resumed.params()) == resumed and resumed.num_windows == 2
    with pytest.raises(RequestError) as err:
        plan_kv_windows(29 + 32 * 64, 29)
    assert err.value.field == "num_frames"


def whole_decode(deployment, finals: list[torch.Tensor]) -> bytes:
    """The deployment's VAE decode of the windows' final latents joined as one latent video."""
    vae = deployment.runtime.workers.workers[0].engines["vae"].vae
    with torch.inference_mode():
        video = vae.decode(vae.denormalize(torch.cat(finals, dim=1)[None]))
    return frames_uint8(video[0]).numpy().tobytes()


def test_kv_windows_decode_as_one_latent_video(deployment):
    """Three streamed windows of 2 latent frames deliver 5, 8 and 8 frames, which joined are
    the VAE's decode of the six latent frames at once (bit for bit); decoded as clips of their
    own the windows would give 3 x 5 frames with a seam at each boundary. A 17-frame rollout
    of the same seed delivers the first 17 of them (window 2 trimmed to 4). The carried state is freed with the
    request."""
    vae = deployment.runtime.workers.workers[0].engines["vae"]
    frame = HEIGHT * WIDTH * 3
    with step_latents(deployment) as seen:
        chunks = events(deployment, "kv-one-video", num_frames=21, seed=11, stream_video=True, **KV)
    assert [len(c) // frame for c in chunks] == [5, 8, 8]
    finals = [seen[w * STEPS + STEPS - 1] for w in range(3)]
    want = whole_decode(deployment, finals)
    assert len(want) == 21 * frame and b"".join(chunks) == want
    apart = np.concatenate([np.frombuffer(whole_decode(deployment, [f]), np.uint8).reshape(5, -1) for f in finals])
    ours = np.frombuffer(want, np.uint8).reshape(21, -1)
    seam = int(np.abs(apart[5].astype(np.int16) - ours[5]).max())  # window 1's first frame
    print(f"[parity] kv windows carried vs one decode: equal; a window decoded alone differs by {seam} levels")
    assert seam > 0
    [trimmed] = events(deployment, "kv-one-video-17", num_frames=17, seed=11, **KV)
    assert trimmed == want[:17 * frame]
    assert not vae.decodes


def test_a_failed_decode_batch_leaves_the_carried_states(checkpoint):
    """A batch of window decodes that fails on one item (the worker then runs each alone to find
    it) has not moved the others' carried states on: run alone, a window decodes from where it
    began, and the rollout's frames are its whole decode's."""
    spec = Cosmos3(config(checkpoint))
    spec.load_frontend()
    engine = spec.build_engines({"vae"}, torch.device("cpu"))["vae"]
    params = plan_kv_windows(13, 5).params()
    gen = torch.Generator().manual_seed(12)
    a, b = (torch.randn((4, 2 * LATENT, HEIGHT // 16, WIDTH // 16), generator=gen) for _ in range(2))

    def window(rid, w, latents):
        return EngineItem(rid, "window_decode", w, {"latents": latents[:, w * LATENT:(w + 1) * LATENT]}, params)

    first = engine.run([window("a", 0, a), window("b", 0, b)])
    with pytest.raises(RuntimeError):
        engine.run([window("a", 1, a), window("b", 1, b[:2])])  # b's latents have the wrong channels
    assert engine.decodes["a"].latent_frames == engine.decodes["b"].latent_frames == LATENT
    [second] = engine.run([window("a", 1, a)])
    frames = torch.cat([first[0].outputs["frames"], second.outputs["frames"]])
    with torch.inference_mode():
        want = frames_uint8(engine.vae.decode(engine.vae.denormalize(a[None]))[0])
    assert frames.shape[0] == 13 and torch.equal(frames, want)
    assert "a" not in engine.decodes  # the last window's state is not kept
    engine.release("b")
    assert not engine.decodes


def test_seeded_kv_rollouts_repeat_and_equal_the_engine_rollout(deployment, checkpoint):
    dit = deployment.runtime.workers.workers[0].engines["dit"]
    with step_latents(deployment) as seen:
        whole = events(deployment, "kv-a", num_frames=13, seed=6, **KV)
    again = events(deployment, "kv-b", num_frames=13, seed=6, **KV)
    other = events(deployment, "kv-c", num_frames=13, seed=7, **KV)
    streamed = events(deployment, "kv-d", num_frames=13, seed=6, stream_video=True, **KV)
    assert len(whole) == 1 and whole == again and whole != other
    frame = HEIGHT * WIDTH * 3
    assert [len(c) // frame for c in streamed] == [5, 8]  # window 1 goes on with the decode: 4 frames a latent
    assert b"".join(streamed) == whole[0]
    finals, _ = Rollout(checkpoint).run("by-hand", 6, 2, 61)
    assert len(seen) == 2 * STEPS
    worst = max(rel(seen[w * STEPS + STEPS - 1], finals[w]) for w in range(2))
    print(f"[parity] kv rollout served vs engine-driven: {worst:.1e}")
    assert worst <= 1e-6
    assert not dit.committed and not dit.prepared  # released with the request
    assert np.frombuffer(whole[0], dtype=np.uint8).std() > 0


def test_a_kv_session_is_resumed_by_a_chained_request(deployment):
    worker = deployment.runtime.workers.workers[0]
    [first] = events(deployment, "kv-sess", session=SessionSpec("kv-world"), num_frames=9, seed=2, **KV)
    kept = worker.sessions.get("kv-world", "vae")
    # the last window whole (8 frames: its decode went on from window 0's), of which the 9-frame
    # clip took the first 4
    assert kept is not None and kept.frames.numpy()[:4].tobytes() == first[-4 * HEIGHT * WIDTH * 3:]
    chained = {"window_mode": "chained", "window_frames": 9, "overlap_frames": 5}
    [more] = events(deployment, "kv-sess-2", session=SessionSpec("kv-world", resume=True, end=True),
                    num_frames=4 + 1, seed=3, **chained)
    assert len(more) == 5 * HEIGHT * WIDTH * 3
    assert kept.decode is None  # the chained window moved the world on: the kv decode is dropped


def test_a_kv_session_resumes_as_one_rollout(deployment):
    """A kv rollout's committed cache is kept in the dit node's session store and its carried
    decode in the vae node's: an opening of 2 windows and a resume of 2 more equal one rollout of
    4 windows with the opening's seed, every step's latents and the frames (the resume's decode
    goes on from the opening's: its windows deliver 8 frames each, so its 16 frames are two whole
    windows; the context releasing frames across the resume); the kept bytes are reported, and
    end_session leaves nothing behind."""
    worker = deployment.runtime.workers.workers[0]
    dit = worker.engines["dit"]
    kv = {**KV, "context_frames": 5}  # 2 latent frames kept: window 0 released while window 2 is made
    with step_latents(deployment) as seen:
        [whole] = events(deployment, "kvs-whole", num_frames=29, seed=8, **kv)  # windows of 5, 8, 8, 8 frames
        [first] = events(deployment, "kvs-open", session=SessionSpec("kv-roll"), num_frames=13, seed=8, **kv)
        cache = worker.sessions.get("kv-roll", "dit")
        assert cache.position == 2 * LATENT and cache.frames == LATENT  # the last window committed too
        assert cache.nbytes > 0 and worker.sessions.held_bytes()["dit"] == cache.nbytes
        kept = worker.sessions.get("kv-roll", "vae")
        assert kept.decode.latent_frames == 2 * LATENT and kept.decode.nbytes > 0
        assert worker.sessions.held_bytes()["vae"] == kept.nbytes == kept.frames.nbytes + kept.decode.nbytes
        [rest] = events(deployment, "kvs-resume", session=SessionSpec("kv-roll", resume=True, end=True),
                        num_frames=16, seed=99, **kv)  # the session's noise stream, not seed 99
    assert len(seen) == 2 * 4 * STEPS
    worst = max(rel(ours, ref) for ours, ref in zip(seen[4 * STEPS:], seen[:4 * STEPS]))
    print(f"[parity] kv opening + resume vs one rollout: latents max rel err {worst:.1e}")
    assert worst <= 1e-5
    frame = HEIGHT * WIDTH * 3
    assert len(first) == 13 * frame and len(rest) == 16 * frame
    assert first + rest == whole  # the decode carried across the resume: no seam, no frame lost
    deadline = time.monotonic() + 10
    while worker.sessions.get("kv-roll", "dit") is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.sessions.get("kv-roll", "dit") is None and worker.sessions.get("kv-roll", "vae") is None
    assert worker.sessions.held_bytes()["dit"] == 0 and not dit.committed and not dit.prepared


def test_a_kv_resume_reencodes_its_prompt(deployment):
    """A resume with another prompt and no guidance goes on from the prompt row's cache."""
    worker = deployment.runtime.workers.workers[0]
    [first] = events(deployment, "kvp-open", session=SessionSpec("kv-prompt"), num_frames=5, seed=8, **KV)

    async def resume():
        spec = GenerateSpec("kvp-resume", "the drone turns toward the harbour", [], ["video"],
                            {"height": HEIGHT, "width": WIDTH, "num_inference_steps": STEPS, "guidance_scale": 1.0,
                             "num_frames": 5, **KV}, session=SessionSpec("kv-prompt", resume=True))
        return [e.data async for e in deployment.backend.generate(spec) if not e.error and e.data]

    [more] = asyncio.run(resume())
    cache = worker.sessions.get("kv-prompt", "dit")
    assert len(more) == len(first) and more != first and len(cache.layers) == 1 and cache.position == 2 * LATENT
    deployment.backend.end_session("kv-prompt")


def test_kv_rollouts_share_forwards_with_other_requests(deployment):
    dit = deployment.runtime.workers.workers[0].engines["dit"]
    jobs = [("kv1", {"num_frames": 13, "seed": 1, **KV}), ("kv2", {"num_frames": 9, "seed": 2, **KV}),
            ("plain", {"num_frames": 9, "seed": 3})]
    alone = {rid: b"".join(events(deployment, f"solo-{rid}", **kw)) for rid, kw in jobs}
    dit.forward_rows.clear()
    with held_until(dit, 2):
        batched = run_together(deployment, jobs)
    assert max(dit.forward_rows) > 2  # rows of different requests packed
    for (rid, _), got in zip(jobs, batched):
        diff = int(np.abs(np.frombuffer(got, np.uint8).astype(np.int16)
                          - np.frombuffer(alone[rid], np.uint8).astype(np.int16)).max())
        print(f"[parity] {rid} packed vs solo: {diff} levels")
        assert diff <= 2  # the packed GEMMs round differently (1e-7)
    assert not dit.committed and not dit.prepared and not dit.solvers


def test_startup_warns_that_kv_is_experimental(checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="mstar.model.cosmos3.model"):
        Cosmos3(config(checkpoint)).load_frontend()
    assert any("window_mode: kv is experimental" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("kwargs", "session", "field"), [
    ({"window_mode": "kv", "context_frames": -1}, None, "context_frames"),
    ({"window_mode": "chained", "context_frames": 61}, None, "context_frames"),
    ({"window_mode": "kv", "overlap_frames": 8}, None, "overlap_frames"),
    ({"window_mode": "kv", "window_frames": 4}, None, "window_frames"),
    ({"window_mode": "kv", "image": True}, SessionSpec("world", resume=True), "image"),
    ({"window_mode": "kv", "num_frames": 16}, None, "num_frames"),  # 4k: a resume's count only
    ({"window_mode": "kv", "num_frames": 18}, SessionSpec("world", resume=True), "num_frames"),
])
def test_bad_kv_requests_name_the_field(deployment, kwargs, session, field):
    from test_cosmos3_conditioned import picture, png  # noqa: PLC0415

    files = [("image.png", png(picture(40, 30, 1)))] if kwargs.pop("image", False) else []
    spec = GenerateSpec("bad", PROMPT, files, ["video"], {"height": HEIGHT, "width": WIDTH, "num_frames": 17, **kwargs},
                        session=session)
    with pytest.raises(RequestError) as err:
        deployment.spec.prepare_generate(spec)
    assert err.value.field == field, err.value
