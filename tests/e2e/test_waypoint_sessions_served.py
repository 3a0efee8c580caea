"""Waypoint with sessions, served in process (a tiny checkpoint with random weights, driven over
httpx's ASGI transport and the ASGI WebSocket client of tests/support/asgi_ws.py).

/generate: a rollout of 3 controls resumed for 4 more equals one request of 7 bit for bit;
ending the session or its eviction leaves nothing on the worker (store and engine), and its
resume is a 410. /generate/ws: the opening names the seed image and seed, 50 controls appended
one a message give 50 frames, in order, equal to one request of the 50 controls; 8 concurrent
sockets equal their solo runs; a client that stops reading is closed with 4008 and its rollout
freed.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
from inprocess import deployed
from PIL import Image

from mstar.server.app import create_app
from mstar.server.generate_ws import CLOSE_NOT_READING
from tests.support.asgi_ws import AsgiSocket
from tests.support.waypoint import write_checkpoint

FRAME_BYTES = 4 * 16 * 32 * 3  # one control's frames: time_upscale x height x width x RGB


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("waypoint-sessions")
    write_checkpoint(root)
    config = {"model": "waypoint", "model_path": str(root), "max_concurrent_requests": 8, "session_store_size": 2,
              "model_kwargs": {"max_frames": 63}}
    with deployed(config) as d:
        yield d, create_app(d.backend)


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (16, 32, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def controls(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"buttons": sorted({int(b) for b in rng.integers(0, 5, 2)}), "mouse": rng.normal(size=2).tolist(),
             "scroll": int(rng.integers(-1, 2))} for _ in range(n)]


def held(d) -> tuple[list[str], dict]:
    """The sessions the worker's store holds and the engine's rollouts, once the runtime is idle
    and the store's drops have arrived (they travel with a later plan than a socket's close: up
    to 10 s is allowed for both before what is still held is returned)."""
    worker = d.runtime.workers.workers[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
            d.runtime.conductor.idle and not d.runtime.tracked and not worker.sessions.sessions
            and not worker.engines["world"].rollouts):
        time.sleep(0.02)
    return sorted(worker.sessions.sessions), worker.engines["world"].rollouts


async def post(app, ctrl: list[dict], *, image: bytes | None = None, seed: int = 5, **session) -> httpx.Response:
    form = {"output_modalities": '["video"]', "model_kwargs": json.dumps({"controls": ctrl, "seed": seed})}
    form |= {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in session.items()}
    files = None if image is None else [("files", ("seed.png", image, "image/png"))]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/generate", data=form, files=files, timeout=120)


def frames(response: httpx.Response) -> list[bytes]:
    """A non-streamed answer's video: one control's frames each."""
    assert response.status_code == 200, response.text
    raw = base64.b64decode(response.json()["data"]["video"])
    assert len(raw) % FRAME_BYTES == 0
    return [raw[i:i + FRAME_BYTES] for i in range(0, len(raw), FRAME_BYTES)]


def test_resume_continues_bit_identically_and_end_frees_it(served):
    d, app = served
    image, ctrl = png(1), controls(7, 2)
    whole = frames(asyncio.run(post(app, ctrl, image=image)))
    first = frames(asyncio.run(post(app, ctrl[:3], image=image, session_id="w")))
    assert held(d) == (["w"], {})  # kept in the store, not the engine
    rest = frames(asyncio.run(post(app, ctrl[3:], seed=99, session_id="w", resume_session=True,  # seed: the session's
                                   end_session=True)))
    assert len(whole) == 7 and first + rest == whole
    assert held(d) == ([], {})
    gone = asyncio.run(post(app, ctrl[:1], session_id="w", resume_session=True))
    assert gone.status_code == 410 and gone.json()["error"]["param"] == "session_id", gone.text
    again = asyncio.run(post(app, ctrl[:1], image=image, session_id="x", resume_session=False))
    frames(again)
    refused = asyncio.run(post(app, ctrl[:1], image=image, session_id="x", resume_session=True, end_session=True))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "files", refused.text


def test_evicted_sessions_leave_nothing(served):
    d, app = served
    for name in ("e1", "e2", "e3"):  # the store keeps 2 idle sessions: e1 goes
        frames(asyncio.run(post(app, controls(1, 3), image=png(2), session_id=name)))
    assert held(d) == (["e2", "e3"], {})
    assert asyncio.run(post(app, controls(1, 3), session_id="e1", resume_session=True)).status_code == 410
    for name in ("e2", "e3"):
        frames(asyncio.run(post(app, controls(1, 3), session_id=name, resume_session=True, end_session=True)))
    assert held(d) == ([], {})


# ------------------------------------------------------------------ /generate/ws
async def ws_rollout(app, image: bytes, ctrl: list[dict], seed: int, stall_after: int | None = None,
                     per_append: int = 1) -> tuple[list, AsgiSocket]:
    """Open a socket naming the seed image and seed, append ``per_append`` controls a message,
    end the input, read everything."""
    async with AsgiSocket(app, stall_after=stall_after) as ws:
        await ws.send_json({"output_modalities": "video", "media": [base64.b64encode(image).decode()],
                            "model_kwargs": {"seed": seed}})
        for i in range(0, len(ctrl), per_append):
            await ws.send_json({"type": "append", "model_kwargs": {"controls": ctrl[i:i + per_append]}})
        await ws.send_json({"type": "end_input"})
        messages = await ws.receive_all()
    return messages, ws


def outputs_of(messages: list) -> tuple[list[bytes], list[int]]:
    """The binary outputs, checked against their headers, and the append each came from."""
    out, appends, expect = [], [], None
    for m in messages:
        if isinstance(m, bytes):
            assert expect is not None and len(m) == expect["bytes"] == FRAME_BYTES
            out.append(m)
            appends.append(expect["append"])
            expect = None
        elif m["type"] == "output":
            assert m["modality"] == "video"
            expect = m
        assert not (isinstance(m, dict) and m["type"] == "error"), m
    return out, appends


def test_ws_fifty_controls_give_fifty_frames_equal_to_one_request(served):
    d, app = served
    image, ctrl = png(7), controls(50, 8)
    messages, ws = asyncio.run(ws_rollout(app, image, ctrl, seed=11))
    assert ws.close_code == 1000, (ws.close_code, ws.close_reason)
    assert messages[0]["type"] == "session" and messages[-1]["type"] == "done"
    assert messages[-1]["appends"] == 50
    got, appends = outputs_of(messages)
    assert appends == list(range(50))  # one frame per control, in order
    assert got == frames(asyncio.run(post(app, ctrl, image=image, seed=11)))
    done = [m["append"] for m in messages if isinstance(m, dict) and m["type"] == "append_done"]
    assert done == list(range(50))
    assert held(d) == ([], {}) and d.runtime.sessions.open == 0
    # a few controls an append: the same frames, still one per control
    few, appends = outputs_of(asyncio.run(ws_rollout(app, image, ctrl[:9], seed=11, per_append=4))[0])
    assert few == got[:9] and appends == [0] * 4 + [1] * 4 + [2]


def test_ws_eight_concurrent_sockets_equal_their_solo_runs(served):
    d, app = served
    runs = [(png(20 + i), controls(6, 30 + i), i) for i in range(8)]
    solo = [outputs_of(asyncio.run(ws_rollout(app, *run))[0])[0] for run in runs]

    async def together():
        return await asyncio.gather(*[ws_rollout(app, *run) for run in runs])

    for (messages, ws), alone in zip(asyncio.run(together()), solo):
        assert ws.close_code == 1000
        assert len(alone) == 6 and outputs_of(messages)[0] == alone
    assert len({b"".join(a) for a in solo}) == 8
    assert held(d) == ([], {})


def test_ws_client_that_stops_reading_is_closed_and_its_rollout_freed(served):
    d, app = served
    messages, ws = asyncio.run(ws_rollout(app, png(3), controls(60, 4), seed=1, stall_after=3, per_append=60))
    assert ws.close_code == CLOSE_NOT_READING, (ws.close_code, ws.close_reason)
    assert held(d) == ([], {}) and d.runtime.sessions.open == 0
