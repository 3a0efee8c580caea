"""What the Cosmos3 windowed-rollout tests share: one tiny deployment's config and request
shape, a request's video chunks as they stream, and requests run together so that their rows
share the tower's forwards."""

from __future__ import annotations

import asyncio

from mstar.config import DeploymentConfig, parse_config
from mstar.contract import GenerateSpec, SessionSpec

HEIGHT, WIDTH = 48, 32
STEPS, GUIDANCE = 2, 2.0
PROMPT = "a drone flies over a coastal town at dawn"


def windowed_config(checkpoint, **knobs) -> DeploymentConfig:
    """Cosmos3 on ``checkpoint`` with windowed rollouts on (and ``knobs``), four at a time."""
    return parse_config({"model": "cosmos3", "model_path": str(checkpoint.root), "max_concurrent_requests": 4,
                         "model_kwargs": {"max_video_pixels": 64 * 64 * 13, "max_image_area": 64 * 64,
                                          "enable_windowed_video": True, **knobs}})


def _spec(request_id: str, files, session: SessionSpec | None, kwargs: dict) -> GenerateSpec:
    return GenerateSpec(request_id, PROMPT, list(files), ["video"],
                        {"height": HEIGHT, "width": WIDTH, "num_inference_steps": STEPS,
                         "guidance_scale": GUIDANCE, **kwargs}, session=session)


async def _chunks(d, spec: GenerateSpec) -> list[bytes]:
    out = []
    async for event in d.backend.generate(spec):
        assert not event.error, event.error
        if event.modality == "video" and event.data:
            out.append(event.data)
    return out


def video_chunks(d, request_id: str, files=(), session: SessionSpec | None = None, **kwargs) -> list[bytes]:
    """The video chunks of one request on deployment ``d`` (uint8 frames; one a window when
    streamed), run alone."""
    return asyncio.run(_chunks(d, _spec(request_id, files, session, kwargs)))


def run_together(d, jobs: list[tuple[str, dict]]) -> list[bytes]:
    """Each ``(name, model_kwargs)`` job's whole video, the jobs submitted at once."""
    async def run():
        return await asyncio.gather(*(_chunks(d, _spec(f"batch-{name}", (), None, kwargs)) for name, kwargs in jobs))

    return [b"".join(chunks) for chunks in asyncio.run(run())]
