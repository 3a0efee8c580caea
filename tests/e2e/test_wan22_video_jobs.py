"""OpenAI's video job API (/v1/videos) over a tiny random Wan2.2 on the CPU: the official
``openai`` client's ``videos.create_and_poll`` and ``download_content`` give an mp4 of the
asked size and length, an image reference conditions it, listing pages with the client's
cursor, deleting a running job cancels it and frees the runtime's per-request state, a finished
job expires after the store's ``ttl_s``, and bad fields are 400s naming the field, the model
family's own rules too (checked before a job exists)."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from live_server import Uvicorn

from mstar.config import parse_config
from mstar.media.video import decode_mp4
from mstar.runtime.launch import start
from mstar.server.app import create_app
from mstar.server.options import VideoJobOptions
from mstar.server.video_jobs import VideoJobs

MODEL = "wan22"
WIDTH, HEIGHT = 32, 64
POLL = {"poll_interval_ms": 20}


def _http_test_module():
    path = Path(__file__).with_name("test_wan22_videos_http.py")
    spec = importlib.util.spec_from_file_location("_wan22_videos_http", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


HTTP = _http_test_module()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    root = HTTP.write_tiny_wan(tmp_path_factory.mktemp("wan22-jobs"))
    knobs = {"max_video_pixels": 64 * 64 * 9, "max_image_area": 64 * 64, "num_inference_steps": 2}
    deployment = start(parse_config({"model": MODEL, "model_path": str(root), "max_concurrent_requests": 4,
                                     "model_kwargs": knobs}), in_process=True)
    app = create_app(deployment.backend, served_model_names=[MODEL])
    try:
        with Uvicorn(app) as live:
            live.app, live.deployment = app, deployment
            yield live
    finally:
        deployment.close()


def create(oai: openai.OpenAI, **extra):
    body = {"num_frames": 5, "fps": 8, "seed": 1} | extra.pop("extra_body", {})
    extra.setdefault("size", f"{WIDTH}x{HEIGHT}")
    return oai.videos.create_and_poll(model=MODEL, prompt="a cat walks", extra_body=body, **POLL, **extra)


def test_create_poll_download(oai: openai.OpenAI) -> None:
    video = create(oai)
    assert video.status == "completed" and video.progress == 100 and video.object == "video"
    assert video.size == f"{WIDTH}x{HEIGHT}" and video.seconds == "0.625" and video.expires_at
    frames, rate = decode_mp4(oai.videos.download_content(video.id).read())
    assert frames.shape == (5, HEIGHT, WIDTH, 3) and rate == 8
    assert oai.videos.retrieve(video.id).status == "completed"
    with pytest.raises(openai.BadRequestError) as err:
        oai.videos.download_content(video.id, variant="thumbnail")
    assert err.value.body["param"] == "variant"


def test_image_reference_and_seconds(oai: openai.OpenAI) -> None:
    video = create(oai, input_reference=("cat.png", HTTP.png(40, 50), "image/png"), seconds="1",
                   extra_body={"num_frames": None})
    assert video.status == "completed", video.error
    frames, _ = decode_mp4(oai.videos.download_content(video.id).read())
    assert frames.shape[0] == 9  # 1 s at 8 fps, as 4k + 1
    plain = create(oai, seconds="1", extra_body={"num_frames": None})
    assert oai.videos.download_content(plain.id).read() != oai.videos.download_content(video.id).read()


def test_bad_fields(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.videos.create(model=MODEL, prompt="x", size="wide")
    assert err.value.body["param"] == "size"
    with pytest.raises(openai.BadRequestError) as err:
        oai.videos.create(model=MODEL, prompt="x", seconds="1", extra_body={"num_frames": 5})
    assert err.value.body["param"] == "num_frames"
    with pytest.raises(openai.BadRequestError) as err:  # the family's rule, checked before a job exists
        oai.videos.create(model=MODEL, prompt="x", size="48x64")
    assert err.value.body["param"] == "size"
    with pytest.raises(openai.BadRequestError) as err:
        oai.videos.create(model=MODEL, prompt="x", size=f"{WIDTH}x{HEIGHT}", extra_body={"num_frames": 5},
                          input_reference=("x.png", b"not a png", "image/png"))
    assert err.value.body["param"] == "input_reference"
    with pytest.raises(openai.BadRequestError) as err:
        oai.videos.create(model=MODEL, prompt="x", size=f"{WIDTH}x{HEIGHT}", extra_body={"num_frames": 6})
    assert err.value.body["param"] == "num_frames"
    assert not [v for v in oai.videos.list() if v.status == "failed"]  # none of them became a job
    with pytest.raises(openai.NotFoundError):
        oai.videos.retrieve("video_nope")


def test_list_pages_and_delete(oai: openai.OpenAI, server: Uvicorn) -> None:
    made = [create(oai, extra_body={"seed": s}).id for s in range(3)]
    listed = [v.id for v in oai.videos.list(limit=2)]  # auto-paging: two pages
    assert listed[:3] == made[::-1]
    page = oai.videos.list(limit=2, order="asc")
    assert page.has_more and len(page.data) == 2
    assert oai.videos.delete(made[0]).deleted
    with pytest.raises(openai.NotFoundError):
        oai.videos.retrieve(made[0])
    # a running job: many steps, deleted at once; its per-request state goes with it
    running = oai.videos.create(model=MODEL, prompt="a cat", size=f"{WIDTH}x{HEIGHT}",
                                extra_body={"num_frames": 9, "num_inference_steps": 100})
    dit = server.deployment.runtime.workers.workers[0].engines["dit"]
    deadline = time.monotonic() + 20
    while not dit.schedules:  # wait until it is denoising
        assert time.monotonic() < deadline and oai.videos.retrieve(running.id).status != "completed"
        time.sleep(0.01)
    assert oai.videos.retrieve(running.id).status == "in_progress"
    assert oai.videos.delete(running.id).deleted
    deadline = time.monotonic() + 20
    while dit.schedules or dit.solvers:
        assert time.monotonic() < deadline, "the deleted job's denoise state was never freed"
        time.sleep(0.05)
    assert create(oai).status == "completed"  # the runtime still serves


def test_ttl_and_bound(oai: openai.OpenAI, server: Uvicorn) -> None:
    kept = server.app.state.video_jobs
    try:
        server.app.state.video_jobs = VideoJobs(VideoJobOptions(ttl_s=1.0))
        first = create(oai)
        assert first.status == "completed" and first.expires_at == first.completed_at + 1
        time.sleep(1.1)
        with pytest.raises(openai.NotFoundError):
            oai.videos.retrieve(first.id)
        server.app.state.video_jobs = VideoJobs(VideoJobOptions(max_jobs=2))
        ids = [create(oai, extra_body={"seed": s}).id for s in range(3)]  # the oldest finished one goes
        assert [v.id for v in oai.videos.list()] == ids[:0:-1]
    finally:
        server.app.state.video_jobs = kept
