"""Cosmos3 windowed rollouts over HTTP (a tiny dummy-weight deployment with
``enable_windowed_video``, in process, driven through httpx's ASGI transport): a chained
rollout of 3 windows with ``stream_video`` streams as 3 NDJSON video lines (9, 4 and 4 frames)
that join into the non-streamed answer's clip; without ``stream_video`` a streamed answer has
one video line; a session resumes with only its new frames, ``end_session`` frees it and its
next resume is a 410 naming ``session_id``; a kv session resumes as one rollout (on ``/generate``
and over ``/generate/ws``); the jobs API
(``/v1/videos``) takes the windowed knobs and sessions; a ``window_mode: kv`` rollout streams its windows
(5, 8 and 4 frames: its decode goes on from window to window, 4 frames a later latent frame, the
last window trimmed) on ``/generate`` and ``/v1/videos/generations``; bad ``context_frames``
(negative, or with chained) are 400s naming it."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
from inprocess import deployed
from test_cosmos3_served import write_tiny_cosmos3

from mstar.server.app import create_app

pytest.importorskip("diffusers")

WIDTH, HEIGHT = 32, 48
FRAME_BYTES = WIDTH * HEIGHT * 3
WINDOW = {"window_mode": "chained", "window_frames": 9, "overlap_frames": 5}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory):
    root = write_tiny_cosmos3(tmp_path_factory.mktemp("cosmos3-windowed"))
    knobs = {"max_video_pixels": 64 * 64 * 9, "max_image_area": 64 * 64, "num_inference_steps": 2,
             "enable_windowed_video": True}
    with deployed({"model": "cosmos3", "model_path": str(root), "load_format": "dummy",
                   "max_concurrent_requests": 4, "model_kwargs": knobs}) as d:
        yield create_app(d.backend)


async def post(app, kwargs: dict, *, streaming: bool = False, **session) -> httpx.Response:
    form = {"text": "a drone flies over a coastal town at dawn", "output_modalities": '["video"]',
            "streaming": str(streaming).lower(),
            "model_kwargs": json.dumps({"width": WIDTH, "height": HEIGHT, "seed": 4, **kwargs})}
    form |= {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in session.items()}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/generate", data=form, timeout=120)


def video_lines(response: httpx.Response) -> list[bytes]:
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    assert not any(line.get("error") for line in lines), lines
    assert lines[-1]["finish_reason"] == "stop"
    return [base64.b64decode(line["data"]) for line in lines if line["modality"] == "video" and line.get("data")]


def clip(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"]["video"])


def test_three_windows_stream_as_three_chunks(app):
    chunks = video_lines(asyncio.run(post(app, {"num_frames": 17, "stream_video": True, **WINDOW}, streaming=True)))
    assert [len(c) // FRAME_BYTES for c in chunks] == [9, 4, 4]
    whole = clip(asyncio.run(post(app, {"num_frames": 17, **WINDOW})))
    assert whole == b"".join(chunks)
    held = video_lines(asyncio.run(post(app, {"num_frames": 17, **WINDOW}, streaming=True)))
    assert held == [whole]  # without stream_video: one assembled clip
    frames = np.frombuffer(whole, dtype=np.uint8).reshape(17, HEIGHT, WIDTH, 3)
    assert frames.std() > 0


def test_a_session_resumes_and_ends(app):
    first = clip(asyncio.run(post(app, {"num_frames": 9, **WINDOW}, session_id="drone")))
    assert len(first) == 9 * FRAME_BYTES
    more = clip(asyncio.run(post(app, {"num_frames": 5, "seed": 8, **WINDOW}, session_id="drone",
                                 resume_session=True)))
    assert len(more) == 5 * FRAME_BYTES  # only the new frames
    last = clip(asyncio.run(post(app, {"num_frames": 5, "seed": 8, **WINDOW}, session_id="drone",
                                 resume_session=True, end_session=True)))
    assert len(last) == 5 * FRAME_BYTES and last != more  # it went on from the later frames
    gone = asyncio.run(post(app, {"num_frames": 5, **WINDOW}, session_id="drone", resume_session=True))
    assert gone.status_code == 410 and gone.json()["error"]["param"] == "session_id", gone.text


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"window_mode": "sliding"}, "window_mode"),
    ({"window_mode": "kv", "context_frames": -1}, "context_frames"),
    ({"window_mode": "chained", "context_frames": 61}, "context_frames"),
    ({"window_mode": "chained", "window_frames": 5}, "window_frames"),
    ({"window_mode": "chained", "window_frames": 9, "overlap_frames": 9}, "overlap_frames"),
    ({"stream_video": "sometimes"}, "stream_video"),
])
def test_bad_windowed_knobs_are_400s_naming_the_field(app, kwargs, field):
    response = asyncio.run(post(app, {"num_frames": 17, **kwargs}))
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


async def post_video(app, body: dict) -> httpx.Response:
    body = {"prompt": "a drone flies over a coastal town at dawn", "size": f"{WIDTH}x{HEIGHT}", "seed": 4, **body}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/v1/videos/generations", json=body, timeout=120)


def test_the_video_route_streams_one_mp4_a_window(app):
    from mstar.media.video import decode_mp4

    response = asyncio.run(post_video(app, {"num_frames": 17, "stream_video": True, **WINDOW}))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    assert [line["type"] for line in lines] == ["video"] * 3 + ["done"]
    assert [line["index"] for line in lines[:3]] == [0, 1, 2]
    counts = [len(decode_mp4(base64.b64decode(line["b64_json"]))[0]) for line in lines[:3]]
    assert counts == [9, 4, 4]
    whole = asyncio.run(post_video(app, {"num_frames": 17, **WINDOW}))  # not streamed: one mp4 of the rollout
    assert whole.status_code == 200, whole.text
    assert len(decode_mp4(base64.b64decode(whole.json()["data"][0]["b64_json"]))[0]) == 17
    refused = asyncio.run(post_video(app, {"num_frames": 17, "stream_video": True, "window_mode": "kv",
                                           "context_frames": -2}))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "context_frames", refused.text


KV = {"window_mode": "kv", "window_frames": 5, "context_frames": 5}


def test_a_kv_rollout_streams_its_windows(app):
    # no overlap, one decode carried across the windows: 1 + 4 (2 - 1), then 4 x 2 a window
    chunks = video_lines(asyncio.run(post(app, {"num_frames": 17, "stream_video": True, **KV}, streaming=True)))
    assert [len(c) // FRAME_BYTES for c in chunks] == [5, 8, 4]
    whole = clip(asyncio.run(post(app, {"num_frames": 17, **KV})))
    assert whole == b"".join(chunks) and len(whole) == 17 * FRAME_BYTES
    assert whole != clip(asyncio.run(post(app, {"num_frames": 17, **KV, "context_frames": 0})))  # 0 keeps window 0
    assert np.frombuffer(whole, dtype=np.uint8).std() > 0
    from mstar.media.video import decode_mp4

    response = asyncio.run(post_video(app, {"num_frames": 17, "stream_video": True, **KV}))
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    assert [line["type"] for line in lines] == ["video"] * 3 + ["done"]
    assert [len(decode_mp4(base64.b64decode(line["b64_json"]))[0]) for line in lines[:3]] == [5, 8, 4]


def test_ws_appends_continue_the_rollout(app):
    """/generate/ws: the socket is one session; the first append starts the rollout, each later
    one resumes it, every window its own binary message."""
    from tests.support.asgi_ws import AsgiSocket

    async def run():
        async with AsgiSocket(app) as ws:
            await ws.send_json({"text": "a drone flies over a coastal town at dawn", "output_modalities": "video",
                                "model_kwargs": {"width": WIDTH, "height": HEIGHT, "seed": 4, "num_frames": 13,
                                                 "stream_video": True, **WINDOW}})
            await ws.send_json({"type": "append"})
            await ws.send_json({"type": "append", "model_kwargs": {"num_frames": 9, "seed": 5}})
            await ws.send_json({"type": "end_input"})
            return await ws.receive_all(), ws

    messages, ws = asyncio.run(run())
    assert ws.close_code == 1000, (ws.close_code, ws.close_reason)
    assert not any(isinstance(m, dict) and m["type"] == "error" for m in messages), messages
    heads = [m for m in messages if isinstance(m, dict) and m["type"] == "output"]
    chunks = [m for m in messages if isinstance(m, bytes)]
    assert [h["append"] for h in heads] == [0, 0, 1, 1, 1]
    assert [len(c) // FRAME_BYTES for c in chunks] == [9, 4, 4, 4, 1]  # then 9 new frames, resumed
    first = clip(asyncio.run(post(app, {"num_frames": 13, **WINDOW})))
    assert b"".join(chunks[:2]) == first


async def run_job(client: httpx.AsyncClient, form: dict) -> dict:
    """POST /v1/videos (a form) and poll the job until
    it is finished."""
    fields = {"prompt": "a drone flies over a coastal town at dawn", "size": f"{WIDTH}x{HEIGHT}", "seed": "4", **form}
    response = await client.post("/v1/videos", data=fields, timeout=120)
    assert response.status_code == 200, response.text
    job = response.json()
    for _ in range(6000):
        if job["status"] in ("completed", "failed"):
            return job
        await asyncio.sleep(0.02)
        job = (await client.get(f"/v1/videos/{job['id']}")).json()
    raise AssertionError(f"job {job['id']} did not finish: {job}")


def test_the_jobs_api_takes_the_windowed_knobs_and_sessions(app):
    """/v1/videos: a chained rollout as a job (its content the whole rollout's mp4, as
    /v1/videos/generations makes it), a kv one, a session opened by one job and resumed by the
    next, a resume of an unknown session failing its job, and 400s naming the field."""
    from mstar.media.video import decode_mp4

    window = {k: str(v) for k, v in WINDOW.items()}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            out = {"chained": await run_job(client, {"num_frames": "17", **window})}
            out["chained_mp4"] = (await client.get(f"/v1/videos/{out['chained']['id']}/content")).content
            out["kv"] = await run_job(client, {"num_frames": "13", **{k: str(v) for k, v in KV.items()}})
            out["kv_mp4"] = (await client.get(f"/v1/videos/{out['kv']['id']}/content")).content
            out["open"] = await run_job(client, {"num_frames": "9", "session_id": "jobs-world", **window})
            out["resume"] = await run_job(client, {"num_frames": "5", "session_id": "jobs-world",
                                                   "resume_session": "true", "end_session": "true", **window})
            out["resume_mp4"] = (await client.get(f"/v1/videos/{out['resume']['id']}/content")).content
            out["gone"] = await run_job(client, {"num_frames": "5", "session_id": "jobs-world",
                                                 "resume_session": "true", **window})
            bad = {}
            for name, form in (("stream_video", {"stream_video": "true"}),
                               ("context_frames", {"window_mode": "kv", "context_frames": "-1"}),
                               ("overlap_frames", {"window_mode": "kv", "overlap_frames": "5"}),
                               ("resume_session", {"resume_session": "true", "window_mode": "chained"})):
                response = await client.post("/v1/videos", data={"prompt": "a drone", "size": f"{WIDTH}x{HEIGHT}",
                                                                 "num_frames": "9", **form})
                bad[name] = response
            json_stream = await client.post("/v1/videos", json={"prompt": "a drone", "stream_video": True})
            bad["stream_video_json"] = json_stream
            return out, bad

    out, bad = asyncio.run(run())
    for name in ("chained", "kv", "open", "resume"):
        assert out[name]["status"] == "completed" and out[name]["progress"] == 100, out[name]
    frames, _ = decode_mp4(out["chained_mp4"])
    assert frames.shape == (17, HEIGHT, WIDTH, 3)
    whole = asyncio.run(post_video(app, {"num_frames": 17, **WINDOW}))
    want, _ = decode_mp4(base64.b64decode(whole.json()["data"][0]["b64_json"]))
    assert np.array_equal(frames, want)  # the same rollout as /v1/videos/generations'
    assert decode_mp4(out["kv_mp4"])[0].shape == (13, HEIGHT, WIDTH, 3)
    assert decode_mp4(out["resume_mp4"])[0].shape == (5, HEIGHT, WIDTH, 3)  # only the new frames
    gone = out["gone"]
    assert gone["status"] == "failed" and gone["error"]["code"] == "invalid_request", gone
    assert gone["error"]["message"].startswith("session_id:"), gone
    for name, response in bad.items():
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == name.removesuffix("_json"), (name, response.text)


def test_a_kv_session_resumes_over_http(app):
    """/generate: a kv rollout opened under a session and resumed equals one kv rollout of both
    requests' windows (the committed cache, the carried decode and the noise stream kept between
    them): the resume's window goes on with the decode, 8 frames of which it asked for 5."""
    first = clip(asyncio.run(post(app, {"num_frames": 5, **KV}, session_id="kv-drone")))
    more = clip(asyncio.run(post(app, {"num_frames": 5, **KV}, session_id="kv-drone", resume_session=True,
                                 end_session=True)))
    whole = clip(asyncio.run(post(app, {"num_frames": 13, **KV})))  # windows of 5 and 8 frames
    assert len(first) == len(more) == 5 * FRAME_BYTES
    assert first + more == whole[:10 * FRAME_BYTES]


def test_ws_appends_continue_a_kv_rollout(app):
    """/generate/ws with window_mode kv: each later append resumes the kv session, and the
    appends' windows equal one kv rollout's."""
    from tests.support.asgi_ws import AsgiSocket

    async def run():
        async with AsgiSocket(app) as ws:
            await ws.send_json({"text": "a drone flies over a coastal town at dawn", "output_modalities": "video",
                                "model_kwargs": {"width": WIDTH, "height": HEIGHT, "seed": 4, "num_frames": 5,
                                                 "stream_video": True, **KV}})
            await ws.send_json({"type": "append"})
            await ws.send_json({"type": "append"})
            await ws.send_json({"type": "end_input"})
            return await ws.receive_all(), ws

    messages, ws = asyncio.run(run())
    assert ws.close_code == 1000, (ws.close_code, ws.close_reason)
    assert not any(isinstance(m, dict) and m["type"] == "error" for m in messages), messages
    chunks = [m for m in messages if isinstance(m, bytes)]
    assert [len(c) // FRAME_BYTES for c in chunks] == [5, 5]
    whole = clip(asyncio.run(post(app, {"num_frames": 13, **KV})))  # windows of 5 and 8 frames
    assert b"".join(chunks) == whole[:10 * FRAME_BYTES]  # the append's window 5 of its 8


def test_resumes_the_worker_refuses_are_400s_naming_the_field(app):
    """Mistakes only the worker can see (what the session holds) come back as the client's
    400 naming the field: a kv resume of a session left chained (a chained resume of one left
    kv is served: the kv rollout keeps its last window's frames) and a resume at another size
    than the session's frames. A failed request ends its session, as any failure does (the
    next resume is a 410)."""
    def refused(opening: dict, resume: dict, field: str, session: str) -> None:
        clip(asyncio.run(post(app, {"num_frames": 5, **opening}, session_id=session)))
        response = asyncio.run(post(app, {"num_frames": 5, **resume}, session_id=session, resume_session=True))
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
        gone = asyncio.run(post(app, {"num_frames": 5, **opening}, session_id=session, resume_session=True))
        assert gone.status_code == 410, gone.text

    refused(WINDOW, KV, "resume_session", "left-chained")
    refused(WINDOW, {**WINDOW, "width": WIDTH + 16}, "size", "resized")
