"""Sessions and /generate/ws, served end to end: the test-only stateful ``toy_rollout``
(tests/support/rollout.py) in an in-process deployment behind the HTTP app, driven over
httpx's ASGI transport and an ASGI WebSocket client (tests/support/asgi_ws.py).

/generate: a resumed session continues bit-identically to an uninterrupted run; a second
request on a busy session gets 409; resuming an unknown, ended, expired or evicted session
gets 410; the state of an ended, expired or evicted session is gone from the worker; with
``session_store_bytes`` the least recently used idle sessions past it are evicted.
/generate/ws: 50 control messages give 50 outputs in order (equal to the reference), 8
concurrent sockets equal their solo runs, a client that stops reading is closed with 4008
and its session freed, malformed messages get an error naming the field.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from inprocess import deployed

import tests.support.rollout as rollout
from mstar.server.app import create_app
from mstar.server.generate_ws import CLOSE_NOT_READING, SEND_QUEUE_MESSAGES
from tests.support.asgi_ws import AsgiSocket

CONFIG = {"model": "toy_rollout", "session_store_size": 2, "session_timeout_max_s": 60}
DIM = rollout.DIM


def controls(n: int, seed: int = 0) -> list[list[float]]:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32).tolist()


@pytest.fixture(scope="module")
def served():
    with deployed(CONFIG) as d:
        yield d, create_app(d.backend)


def worker_sessions(d) -> set[str]:
    return set(d.runtime.workers.workers[0].sessions.sessions)


def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def idle(d) -> bool:
    return d.runtime.conductor.idle and not d.runtime.tracked


async def post(app, ctrl: list[list[float]], **fields) -> httpx.Response:
    form = {"model_kwargs": json.dumps({"controls": ctrl}), "output_modalities": "latent"}
    form |= {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in fields.items()}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/generate", data=form, timeout=60)


def frames(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    import base64

    return np.frombuffer(base64.b64decode(response.json()["data"]["latent"]), "<f4").reshape(-1, DIM)


def test_resume_continues_bit_identically(served):
    d, app = served
    ctrl = controls(12, seed=1)
    whole = frames(asyncio.run(post(app, ctrl)))
    np.testing.assert_array_equal(whole, rollout.reference(ctrl))
    parts = [frames(asyncio.run(post(app, ctrl[:5], session_id="r1"))),
             frames(asyncio.run(post(app, ctrl[5:9], session_id="r1", resume_session=True))),
             frames(asyncio.run(post(app, ctrl[9:], session_id="r1", resume_session=True, end_session=True)))]
    assert np.array_equal(np.concatenate(parts), whole)  # bit for bit
    # a fresh start under the same name forgets the old state
    again = frames(asyncio.run(post(app, ctrl[:3], session_id="r1")))
    assert np.array_equal(again, whole[:3])
    wait_until(lambda: idle(d), "the requests are released")
    assert "r1" in worker_sessions(d)
    asyncio.run(post(app, ctrl[:1], session_id="r1", resume_session=True, end_session=True))
    wait_until(lambda: "r1" not in worker_sessions(d), "the ended session's state is freed on the worker")


def test_end_session_frees_state_and_resume_gets_410(served):
    d, app = served
    frames(asyncio.run(post(app, controls(3), session_id="e1", end_session=True)))
    wait_until(lambda: "e1" not in worker_sessions(d), "the ended session is freed on the worker")
    gone = asyncio.run(post(app, controls(1), session_id="e1", resume_session=True))
    assert gone.status_code == 410
    assert gone.json()["error"]["param"] == "session_id" and "'e1'" in gone.json()["error"]["message"]
    never = asyncio.run(post(app, controls(1), session_id="never-made", resume_session=True))
    assert never.status_code == 410 and "'never-made'" in never.json()["error"]["message"]
    bad = asyncio.run(post(app, controls(1), resume_session=True))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "resume_session"


def test_second_request_on_a_busy_session_gets_409(served):
    d, app = served
    engine = d.runtime.workers.workers[0].engines["roll"]

    async def scenario():
        engine.gate.clear()
        try:
            first = asyncio.ensure_future(post(app, controls(4), session_id="b1"))
            while d.runtime.sessions.busy == 0:
                await asyncio.sleep(0.01)
            second = await post(app, controls(1), session_id="b1", resume_session=True)
            fresh = await post(app, controls(1), session_id="b1")  # starting it afresh is refused too
        finally:
            engine.gate.set()
        return await first, second, fresh

    first, second, fresh = asyncio.run(scenario())
    assert first.status_code == 200
    for refused in (second, fresh):
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["param"] == "session_id" and "'b1'" in refused.json()["error"]["message"]
    # the first request's state survived the refusals
    np.testing.assert_array_equal(frames(first), rollout.reference(controls(4)))
    asyncio.run(post(app, controls(1), session_id="b1", resume_session=True, end_session=True))


def test_idle_sessions_are_evicted_least_recently_used_first(served):
    d, app = served
    for name in ("v1", "v2", "v3"):  # the store keeps 2 idle sessions
        frames(asyncio.run(post(app, controls(2), session_id=name)))
    wait_until(lambda: worker_sessions(d) == {"v2", "v3"}, "the worker holds the two newest sessions")
    assert asyncio.run(post(app, controls(1), session_id="v1", resume_session=True)).status_code == 410
    ctrl = controls(2) + controls(1, seed=5)
    resumed = frames(asyncio.run(post(app, ctrl[2:], session_id="v2", resume_session=True)))
    np.testing.assert_array_equal(resumed, rollout.reference(ctrl)[2:])
    for name in ("v2", "v3"):
        asyncio.run(post(app, controls(1), session_id=name, resume_session=True, end_session=True))
    wait_until(lambda: not worker_sessions(d), "no session state is left on the worker")


def test_an_idle_session_expires(served):
    d, app = served
    frames(asyncio.run(post(app, controls(2), session_id="t1", session_timeout_s=0.2)))
    wait_until(lambda: "t1" not in worker_sessions(d) and d.runtime.sessions.open == 0,
               "the expired session is freed on the worker")
    assert asyncio.run(post(app, controls(1), session_id="t1", resume_session=True)).status_code == 410


def test_metrics_count_sessions(served):
    d, app = served
    frames(asyncio.run(post(app, controls(1), session_id="m1")))
    wait_until(lambda: d.runtime.gauges().get("rank0.roll.sessions_held") == 1.0, "the worker reports the session")
    gauges = d.runtime.gauges()
    assert gauges["sessions_open"] == 1.0 and gauges["sessions_busy"] == 0.0
    scraped = asyncio.run(scrape(app))
    assert 'mstar_sessions_held{node="roll",rank="0"} 1.0' in scraped and "mstar_sessions_open 1.0" in scraped
    asyncio.run(post(app, controls(1), session_id="m1", resume_session=True, end_session=True))
    wait_until(lambda: d.runtime.sessions.open == 0 and not worker_sessions(d), "the session is gone")
    frames(asyncio.run(post(app, controls(1))))  # a plan after the drop carries the rank's gauges
    wait_until(lambda: d.runtime.gauges().get("rank0.roll.sessions_held") == 0.0, "the worker reports none")


def test_idle_session_bytes_past_session_store_bytes_are_evicted():
    """A deployment with ``session_store_bytes: 100``: each kept frame is 16 bytes (``Trail``).
    The worker reports each session's bytes with its steps; a third session past 100 bytes evicts
    the least recently used one (410 on resume, freed on the worker), and a session of 112 bytes
    by itself is served but not kept."""
    frame = 4 * DIM
    with deployed({"model": "toy_rollout", "session_store_bytes": 100, "session_timeout_max_s": 60}) as d:
        app = create_app(d.backend)
        sizes = {"w1": 3, "w2": 2}
        for name, steps in sizes.items():
            frames(asyncio.run(post(app, controls(steps), session_id=name)))
        wait_until(lambda: worker_sessions(d) == {"w1", "w2"}, "the worker holds both sessions")
        assert d.runtime.gauges()["rank0.roll.session_bytes"] == 5 * frame  # 80 bytes: within the budget
        frames(asyncio.run(post(app, controls(2), session_id="w3")))  # 112 bytes: w1 is the least recent
        wait_until(lambda: worker_sessions(d) == {"w2", "w3"}, "w1 is evicted on the worker")
        gone = asyncio.run(post(app, controls(1), session_id="w1", resume_session=True))
        assert gone.status_code == 410 and "'w1'" in gone.json()["error"]["message"]
        ctrl = controls(2) + controls(1, seed=5)  # w2 was kept whole: its resume goes on from it
        resumed = frames(asyncio.run(post(app, ctrl[2:], session_id="w2", resume_session=True)))
        np.testing.assert_array_equal(resumed, rollout.reference(ctrl)[2:])
        big = frames(asyncio.run(post(app, controls(7, seed=2), session_id="big")))  # 112 bytes alone
        np.testing.assert_array_equal(big, rollout.reference(controls(7, seed=2)))  # served in full
        wait_until(lambda: d.runtime.sessions.open == 2 and idle(d), "the oversized session is dropped")
        assert asyncio.run(post(app, controls(1), session_id="big", resume_session=True)).status_code == 410
        wait_until(lambda: worker_sessions(d) == {"w2", "w3"}, "only the kept sessions are held on the worker")


async def scrape(app) -> str:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return (await client.get("/metrics")).text


# ------------------------------------------------------------------ /generate/ws
async def ws_rollout(app, ctrl: list[list[float]], *, binary: bool = False) -> tuple[list, AsgiSocket]:
    """Open a socket, append one control per message, end the input, read everything."""
    async with AsgiSocket(app) as ws:
        await ws.send_json({"output_modalities": "latent"})
        for c in ctrl:
            if binary:
                await ws.send_bytes(np.asarray(c, "<f4").tobytes())
            else:
                await ws.send_json({"type": "append", "model_kwargs": {"controls": [c]}})
        await ws.send_json({"type": "end_input"})
        messages = await ws.receive_all()
    return messages, ws


def outputs_of(messages: list) -> np.ndarray:
    """The frames of the binary messages, checked against their headers and appends' order."""
    out, expect, appends = [], None, []
    for m in messages:
        if isinstance(m, bytes):
            assert expect is not None and len(m) == expect["bytes"]
            out.append(np.frombuffer(m, "<f4"))
            appends.append(expect["append"])
            expect = None
        elif m["type"] == "output":
            expect = m
    assert appends == sorted(appends)
    return np.stack(out) if out else np.zeros((0, DIM), np.float32)


def test_ws_fifty_controls_give_fifty_outputs_in_order(served):
    d, app = served
    ctrl = controls(50, seed=7)
    messages, ws = asyncio.run(ws_rollout(app, ctrl))
    assert ws.close_code == 1000, (ws.close_code, ws.close_reason)
    assert messages[0]["type"] == "session" and messages[-1]["type"] == "done"
    assert messages[-1]["appends"] == 50 and messages[-1]["session_kept"] is False
    got = outputs_of(messages)
    assert got.shape == (50, DIM)
    np.testing.assert_array_equal(got, rollout.reference(ctrl))
    done = [m["append"] for m in messages if isinstance(m, dict) and m["type"] == "append_done"]
    assert done == list(range(50))
    wait_until(lambda: idle(d) and not worker_sessions(d) and d.runtime.sessions.open == 0,
               "the socket's session is freed")
    # binary appends (float32 controls) give the same frames
    binary, _ = asyncio.run(ws_rollout(app, ctrl[:10], binary=True))
    np.testing.assert_array_equal(outputs_of(binary), rollout.reference(ctrl[:10]))


def test_ws_eight_concurrent_sockets_equal_their_solo_runs(served):
    d, app = served
    runs = [controls(12, seed=100 + i) for i in range(8)]
    solo = [outputs_of(asyncio.run(ws_rollout(app, ctrl))[0]) for ctrl in runs]

    async def together():
        return await asyncio.gather(*[ws_rollout(app, ctrl) for ctrl in runs])

    for (messages, ws), alone, ctrl in zip(asyncio.run(together()), solo, runs):
        assert ws.close_code == 1000
        np.testing.assert_array_equal(outputs_of(messages), alone)
        np.testing.assert_array_equal(alone, rollout.reference(ctrl))
    wait_until(lambda: idle(d) and not worker_sessions(d), "every socket's session is freed")


def test_ws_client_that_stops_reading_is_closed_and_its_session_freed(served):
    d, app = served

    async def scenario():
        async with AsgiSocket(app, stall_after=3) as ws:
            await ws.send_json({"output_modalities": "latent", "session_id": "slow"})
            await ws.send_json({"type": "append", "model_kwargs": {"controls": controls(2 * SEND_QUEUE_MESSAGES)}})
            await ws.send_json({"type": "end_input"})
            await ws.receive_all()
        return ws

    ws = asyncio.run(scenario())
    assert ws.close_code == CLOSE_NOT_READING, (ws.close_code, ws.close_reason)
    assert "did not read" in ws.close_reason
    wait_until(lambda: idle(d) and "slow" not in worker_sessions(d) and "slow" not in d.runtime.sessions,
               "the slow client's request is cancelled and its session freed")


def test_ws_malformed_messages_name_the_field(served):
    d, app = served

    async def scenario():
        async with AsgiSocket(app) as ws:
            await ws.send_json({"output_modalities": "latent", "session_id": "named"})
            assert (await ws.receive())["type"] == "session"
            await ws.send_text("not json")
            await ws.send_json({"type": "push"})
            await ws.send_json({"type": "append", "model_kwargs": {"controls": [[1.0]]}})
            await ws.send_json({"type": "append", "model_kwargs": "x"})
            await ws.send_json({"type": "append", "colour": 1})
            await ws.send_json({"type": "append", "model_kwargs": {"controls": controls(2)}})
            await ws.send_json({"type": "end_input"})
            return await ws.receive_all(), ws

    messages, ws = asyncio.run(scenario())
    errors = [(m["field"], m["status"]) for m in messages if isinstance(m, dict) and m["type"] == "error"]
    # the reader refuses what it cannot parse at once, the model what it cannot run when its turn comes
    assert sorted(errors) == sorted([("message", 400), ("type", 400), ("model_kwargs.controls", 400),
                                     ("model_kwargs", 400), ("colour", 400)])
    np.testing.assert_array_equal(outputs_of(messages), rollout.reference(controls(2)))  # the socket still worked
    assert messages[-1] == {"type": "done", "appends": 1, "session_id": "named", "session_kept": True}
    assert ws.close_code == 1000
    resumed = frames(asyncio.run(post(app, controls(1, seed=9), session_id="named", resume_session=True,
                                      end_session=True)))
    np.testing.assert_array_equal(resumed, rollout.reference(controls(2) + controls(1, seed=9))[2:])

    async def opening(body):
        async with AsgiSocket(app) as ws:
            await ws.send_json(body)
            return await ws.receive_all(), ws

    for body, field in (({"session_timeout_s": -1}, "session_timeout_s"), ({"sesion_id": "x"}, "sesion_id"),
                        ({"end_session": True}, "end_session"), ({"model_kwargs": "{"}, "model_kwargs")):
        messages, ws = asyncio.run(opening(body))
        assert len(messages) == 1 and messages[0]["type"] == "error" and messages[0]["field"] == field, messages
        assert ws.close_code == 1008
    wait_until(lambda: idle(d) and not worker_sessions(d), "nothing is left")


def test_sdk_and_a_real_socket(served):
    """The SDK's session arguments, and /generate/ws over uvicorn and a real WebSocket client."""
    from live_server import Uvicorn
    from websockets.sync.client import connect

    from mstar import MStarClient
    from mstar.client.errors import MStarError

    d, app = served
    ctrl = controls(6, seed=11)
    with Uvicorn(app) as server, MStarClient(server.url, timeout=30) as sdk:
        def run(part, **session):
            out = sdk.generate(output_modalities=["latent"], model_kwargs={"controls": part}, **session)
            return np.frombuffer(out.data["latent"], "<f4").reshape(-1, DIM)

        got = np.concatenate([run(ctrl[:2], session_id="sdk"),
                              run(ctrl[2:], session_id="sdk", resume_session=True, end_session=True)])
        np.testing.assert_array_equal(got, rollout.reference(ctrl))
        with pytest.raises(MStarError) as err:
            run(ctrl[:1], session_id="sdk", resume_session=True)
        assert err.value.status == 410

        with connect(server.url.replace("http", "ws") + "/generate/ws") as ws:
            ws.send(json.dumps({"output_modalities": "latent"}))
            for c in ctrl:
                ws.send(json.dumps({"type": "append", "model_kwargs": {"controls": [c]}}))
            ws.send(json.dumps({"type": "end_input"}))
            messages = []
            while True:
                raw = ws.recv(timeout=30)
                messages.append(raw if isinstance(raw, bytes) else json.loads(raw))
                if isinstance(messages[-1], dict) and messages[-1]["type"] == "done":
                    break
        np.testing.assert_array_equal(outputs_of(messages), rollout.reference(ctrl))
    wait_until(lambda: idle(d) and not worker_sessions(d), "nothing is left")


def test_ws_checks_the_api_key(served):
    d, _ = served
    app = create_app(d.backend, api_key="k3y")

    async def attempt(headers):
        async with AsgiSocket(app, headers=headers) as ws:
            await ws.send_json({"output_modalities": "latent", "end_input": True,
                                "model_kwargs": {"controls": controls(2)}})
            return await ws.receive_all(), ws

    messages, ws = asyncio.run(attempt([]))
    assert messages == [{"type": "error", "field": None, "status": 401, "message": "missing or invalid API key"}]
    assert ws.close_code == 1008
    messages, ws = asyncio.run(attempt([(b"authorization", b"Bearer k3y")]))  # a one-shot request
    assert ws.close_code == 1000 and messages[-1]["appends"] == 1
    np.testing.assert_array_equal(outputs_of(messages), rollout.reference(controls(2)))


def test_ws_a_second_socket_on_a_busy_session_gets_4409_and_leaves_it_alone(served):
    d, app = served
    engine = d.runtime.workers.workers[0].engines["roll"]
    ctrl = controls(3, seed=21)

    async def scenario():
        engine.gate.clear()
        try:
            async with AsgiSocket(app) as first:
                await first.send_json({"output_modalities": "latent", "session_id": "shared"})
                await first.send_json({"type": "append", "model_kwargs": {"controls": ctrl[:2]}})
                while d.runtime.sessions.busy == 0:
                    await asyncio.sleep(0.01)
                async with AsgiSocket(app) as second:
                    await second.send_json({"output_modalities": "latent", "session_id": "shared",
                                            "resume_session": True})
                    await second.send_json({"type": "append", "model_kwargs": {"controls": ctrl[2:]}})
                    refused = await second.receive_all()
                engine.gate.set()
                await first.send_json({"type": "end_input"})
                return refused, second, await first.receive_all(), first
        finally:
            engine.gate.set()

    refused, second, accepted, first = asyncio.run(scenario())
    assert second.close_code == 4409 and "'shared'" in second.close_reason
    assert [m["status"] for m in refused if m["type"] == "error"] == [409]
    assert first.close_code == 1000 and accepted[-1]["session_kept"] is True
    resumed = frames(asyncio.run(post(app, ctrl[2:], session_id="shared", resume_session=True, end_session=True)))
    np.testing.assert_array_equal(np.concatenate([outputs_of(accepted), resumed]), rollout.reference(ctrl))
    wait_until(lambda: idle(d) and not worker_sessions(d), "nothing is left")
