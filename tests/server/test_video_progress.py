"""The video routes' use of progress events: ``run_video`` passes each "step k of n" to its
listener and still returns the frames; a job's percentage follows the steps but stays below
100 until its mp4 exists."""

from __future__ import annotations

import asyncio

import numpy as np

from mstar.contract import GenerateSpec, OutputEvent
from mstar.server.video_jobs import Job, _progressed
from mstar.server.video_routes import run_video


class SteppingBackend:
    """Three denoising steps, then a 2-frame 4x2 video."""

    def __init__(self) -> None:
        self.frames = np.arange(2 * 2 * 4 * 3, dtype=np.uint8).reshape(2, 2, 4, 3)

    async def generate(self, spec: GenerateSpec):
        for k in (1, 2, 3):
            yield OutputEvent(modality="progress", progress=(k, 3))
        yield OutputEvent(modality="video", data=self.frames.tobytes())
        yield OutputEvent(finish_reason="stop")


def test_run_video_reports_each_step_and_returns_the_frames() -> None:
    backend, heard = SteppingBackend(), []
    spec = GenerateSpec(request_id="v", text="x", files=[], output_modalities=["video"],
                        model_kwargs={"width": 4, "height": 2})
    video = asyncio.run(run_video(backend, spec, {}, on_progress=lambda k, n: heard.append((k, n))))
    assert heard == [(1, 3), (2, 3), (3, 3)]
    assert np.array_equal(video.frames, backend.frames) and video.audio is None


def test_a_job_percentage_follows_the_steps_below_100() -> None:
    job = Job("video_1", 0, "wan22", "a cat", "32x64", "1")
    seen = []
    for k in range(1, 5):
        _progressed(job, k, 4)
        seen.append(job.progress)
    assert seen == [25, 50, 75, 99]
