"""Client streams: a walk input the client appends to while the request runs, feeding a chain
of stream edges (an encoder stage, then a frame-synchronous decode stage) that end when the
client ends its input. The conductor on fabricated results, then the real runtime in process
with toy engines: appends flow in order, ``end_input`` ends the request, a disconnect frees
every engine state and stored item, and the stream's cap is counted before any node."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from mstar.config import parse_config
from mstar.contract import GenerateSpec, OutputEvent, RequestError
from mstar.engine.base import Engine, EngineOutput, StatelessEngine
from mstar.graph import ClientStream, Emit, FixedFrames, Graph, GraphError, Node, Step, StreamEdge, Walk
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest
from mstar.runtime.conductor import Conductor
from mstar.runtime.launch import start
from mstar.runtime.placement import single_rank
from mstar.runtime.protocol import ItemResult, StepResult


def duplex_graph() -> Graph:
    """prime (the body) -> audio_in (client stream) -> enc -> frames -> llm.decode (emits)."""
    nodes = [Node("enc", "stateless", inputs=("audio",), outputs=("frames",)),
             Node("llm", "autoregressive", inputs=("prompt", "frame", "primed"), outputs=("primed", "token"),
                  ops=("prime", "decode"))]
    prime = Step("llm", "prime", reads="prompt", writes="primed")
    encode = StreamEdge("audio_in", into=Step("enc", reads={"audio": "audio_in"}, writes="frames"),
                        policy=FixedFrames(1))
    decode = StreamEdge("frames", into=Step("llm", "decode", reads={"frame": "frames", "primed": "primed"},
                                            writes="token", emit=Emit("token", "text")),
                        policy=FixedFrames(1), port="frame")
    walk = Walk("duplex", prime, inputs="prompt", streams=[encode, decode],
                client_streams=[ClientStream("audio_in", max_items="max_samples")])
    return Graph.build(nodes, [walk])


# ------------------------------------------------------------------ the conductor alone


def test_graph_refuses_a_client_stream_nothing_reads_and_an_unknown_source():
    node = Node("enc", "stateless", inputs=("audio",), outputs=("frames",))
    with pytest.raises(GraphError, match="feeds no stream edge"):
        Graph.build([node], [Walk("w", Step("enc", reads={"audio": "x"}, writes="frames"), inputs=("x",),
                                  client_streams=[ClientStream("mic")])])
    edge = StreamEdge("nowhere", into=Step("enc", reads={"audio": "nowhere"}, writes="frames"), policy=FixedFrames(1))
    with pytest.raises(GraphError, match="client stream or the consumer of an earlier stream edge"):
        Graph.build([node], [Walk("w", Step("enc", reads={"audio": "x"}, writes="frames", name="e0"),
                                  inputs=("x",), streams=[edge])])


def _answer(c: Conductor, plan, frames_of=lambda item: True) -> StepResult:
    results = []
    for item in plan.items:
        silent = [] if frames_of(item) else list(item.writes)
        results.append(ItemResult(item.request_id, item.step, emitted=len(item.emit) if not silent else 0,
                                  silent=silent))
    result = StepResult(0, plan.plan_id, results)
    c.on_result(result)
    return result


def _ticks(c: Conductor, n: int, log: list, frames_of=lambda item: True, lasts=None):
    lasts = [] if lasts is None else lasts
    for _ in range(n):
        d = c.tick(0.0)
        for plan in d.plans.values():
            log.extend((i.step, i.chunk.versions if i.chunk else None) for i in plan.items)
            lasts.extend(i.chunk.last for i in plan.items if i.step == "enc.forward")
            _answer(c, plan, frames_of)
        if d.finished:
            return d.finished
    return []


def test_conductor_runs_appends_in_order_and_ends_only_at_end_input():
    graph = duplex_graph()
    c = Conductor(graph, single_rank(graph), max_concurrent_requests=4)
    from mstar.runtime.conductor import RequestSpec
    c.submit(RequestSpec("r", "duplex", {"max_samples": 100}))
    c.append("r", "audio_in", -1)  # before admission: kept for it
    log: list = []
    assert _ticks(c, 6, log) == []
    # prime first; the decode stage waits for it even though the encoder ran
    assert log[0][0] == "llm.prime"
    for v in (-2, -3):
        c.append("r", "audio_in", v)
    assert _ticks(c, 10, log) == []  # the input is open: nothing ends, however long it idles
    enc = [versions for step, versions in log if step == "enc.forward"]
    assert enc == [[-1], [-2], [-3]]
    assert c.live["r"].streams[0].dropped == 3  # each chunk told its rank to free its item
    decodes = [versions for step, versions in log if step == "llm.decode"]
    assert len(decodes) == 3 and all(len(v) == 1 for v in decodes)
    c.end_input("r", [("audio_in", -4)])  # with the stream's empty end marker
    lasts: list = []
    finished = _ticks(c, 5, log, lasts=lasts)
    assert [f.request_id for f in finished] == ["r"] and finished[0].error is None
    assert [v for step, v in log if step == "enc.forward"][-1] == [-4] and lasts == [True]
    assert c.idle or not c.live


def test_conductor_chunk_that_made_no_frames_feeds_nothing_and_end_input_before_admission():
    graph = duplex_graph()
    c = Conductor(graph, single_rank(graph), max_concurrent_requests=1)
    from mstar.runtime.conductor import RequestSpec
    c.submit(RequestSpec("a", "duplex", {"max_samples": 10}))
    c.submit(RequestSpec("b", "duplex", {"max_samples": 10}))  # waits: one at a time
    c.append("b", "audio_in", -1)
    c.end_input("b")
    c.end_input("a")  # a one-shot call with no audio ends once primed
    log: list = []
    # every other encoder chunk makes no frames (a silent port): the decode stage skips it
    done = _ticks(c, 8, log, frames_of=lambda item: item.step != "enc.forward")
    assert [f.request_id for f in done] == ["a"]
    done = _ticks(c, 8, log, frames_of=lambda item: item.step != "enc.forward")
    assert [f.request_id for f in done] == ["b"]
    assert not any(step == "llm.decode" for step, _ in log)


# ------------------------------------------------------------------ the real runtime

HELD: dict[str, object] = {}  # the toy engines' per-request state, to see it freed


class ToyEncoder(StatelessEngine):
    """Turns an append of ``n`` samples into ``n // 2`` frames (the samples of even index,
    times ten), keeping an odd leftover sample for the next append, as a real front end
    keeps the audio it cannot frame yet."""

    def __init__(self):
        self.left: dict[str, torch.Tensor] = {}
        HELD["enc"] = self.left
        super().__init__(self._encode)

    def _encode(self, op, items):
        out = []
        for item in items:
            audio = torch.cat([self.left.get(item.request_id, torch.zeros(0)), item.inputs["audio"].flatten()])
            usable = audio.shape[0] // 2 * 2
            self.left[item.request_id] = audio[usable:]
            frames = audio[:usable:2] * 10
            out.append({"frames": frames} if frames.numel() else {})
        return out

    def release(self, request_id):
        self.left.pop(request_id, None)


class ToyDecoder(Engine):
    """Frame-synchronous: each frame's token is the frame plus the previous token."""

    def __init__(self):
        self.last: dict[str, float] = {}
        HELD["llm"] = self.last

    def run(self, items):
        outs = []
        for item in items:
            if item.op == "prime":
                self.last[item.request_id] = float(item.inputs["prompt"].sum())
                outs.append(EngineOutput({"primed": torch.ones(1)}))
                continue
            tokens = []
            for frame in item.inputs["frame"].tolist():
                self.last[item.request_id] += frame
                tokens.append(self.last[item.request_id])
            outs.append(EngineOutput({"token": torch.tensor(tokens)}))
        return outs

    def release(self, request_id):
        self.last.pop(request_id, None)


class Values(OutputStream):
    def feed(self, modality, value):
        return OutputEvent(modality=modality, token_ids=[int(v) for v in value.tolist()])


@register
class ToyDuplex(ModelSpec):
    key = "toy_duplex"
    tasks = frozenset()

    def graph(self):
        return duplex_graph()

    def load_frontend(self):
        pass

    def build_engines(self, nodes, device):
        engines = {"enc": ToyEncoder(), "llm": ToyDecoder()}
        return {name: engines[name] for name in nodes}

    def prepare_generate(self, spec):
        return WalkRequest("duplex", {"prompt": torch.tensor([float(spec.model_kwargs.get("start", 0))])},
                           {"max_samples": 64}, end_input=bool(spec.model_kwargs.get("one_shot")),
                           appends={"audio_in": [torch.tensor(spec.model_kwargs["clip"], dtype=torch.float32)]}
                           if "clip" in spec.model_kwargs else {})

    def output_stream(self, request, stop):
        return Values()


@pytest.fixture(scope="module")
def deployment():
    d = start(parse_config({"model": "toy_duplex", "max_concurrent_requests": 4}), in_process=True)
    yield d
    d.close()


def expected(start: int, samples: list[float]) -> list[int]:
    total, out = start, []
    for s in samples[: len(samples) // 2 * 2: 2]:
        total += s * 10
        out.append(int(total))
    return out


async def _call(d, rid, appends, *, start=0, end=True, gap=0.0):
    """Open a call, append each list of samples, end the input; the tokens and the last event."""
    events = d.backend.generate(GenerateSpec(rid, "", [], ["text"], {"start": start}))
    tokens, last = [], None

    async def read():
        nonlocal last
        async for event in events:
            tokens.extend(event.token_ids)
            last = event

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.05)  # the request is submitted
    for samples in appends:
        d.runtime.append(rid, "audio_in", torch.tensor(samples, dtype=torch.float32))
        await asyncio.sleep(gap)
    if end:
        d.runtime.end_input(rid)
        await asyncio.wait_for(reader, 10)
    return tokens, last, reader


def _held_nothing(d) -> bool:
    worker = d.runtime.workers.workers[0]
    return (not HELD["enc"] and not HELD["llm"] and len(worker.store._values) == 0
            and not d.runtime.conductor.live and not d.runtime.tracked)


def _wait_free(d) -> None:
    deadline = time.monotonic() + 5
    while not _held_nothing(d) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _held_nothing(d)


def test_appends_flow_in_order_and_end_input_ends_the_call(deployment):
    appends = [[1, 2, 3], [4], [5, 6, 7, 8], [], [9, 10]]
    tokens, last, _ = asyncio.run(_call(deployment, "live", appends, start=3, gap=0.01))
    flat = [s for a in appends for s in a]
    assert tokens == expected(3, flat)
    assert last.finish_reason == "stop" and last.error is None
    _wait_free(deployment)


def _one_shot(d, rid: str, clip: list[float]) -> list[int]:
    """A whole clip uploaded at once (one append, then end of input): its tokens."""
    async def go():
        out = []
        async for event in d.backend.generate(GenerateSpec(rid, "", [], ["text"], {"clip": clip, "one_shot": True})):
            out += event.token_ids
        return out

    return asyncio.run(go())


def test_one_shot_upload_is_one_append_with_end_input(deployment):
    assert _one_shot(deployment, "once", [2, 0, 4, 0, 6]) == expected(0, [2, 0, 4, 0, 6])
    _wait_free(deployment)


def test_a_disconnect_frees_every_state_and_item(deployment):
    async def go():
        tokens, _, reader = await _call(deployment, "gone", [[1, 1], [2, 2]], end=False, gap=0.05)
        await asyncio.sleep(0.2)
        assert not reader.done()  # no end_input: the call stays open
        assert HELD["llm"]  # the decoder holds the call's state
        store = deployment.runtime.workers.workers[0].store._values
        # consumed stream items are freed as the call goes, not kept until it ends
        assert not store.get(("gone", "audio_in")) and not store.get(("gone", "frames"))
        reader.cancel()  # the client hangs up
        try:
            await reader
        except asyncio.CancelledError:
            pass

    asyncio.run(go())
    _wait_free(deployment)


def test_a_call_waiting_for_audio_does_not_spin_the_loop(deployment):
    """An open call with every rank idle, waiting for the client's next append: the runtime
    loop waits for an event or a command (a poll of up to 50 ms), not a tick after tick; the
    append still reaches the decoder at once."""
    runtime = deployment.runtime
    ticks = 0
    tick = runtime.conductor.tick

    def counted(now):
        nonlocal ticks
        ticks += 1
        return tick(now)

    async def go():
        nonlocal ticks
        tokens, _, reader = await _call(deployment, "idle", [[1, 2]], end=False)
        deadline = time.monotonic() + 5
        while not tokens and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the primed call now waits on its client
        ticks = 0
        await asyncio.sleep(0.5)
        assert ticks <= 30, ticks  # a spin ticks thousands of times in 0.5 s
        sent = time.monotonic()
        runtime.append("idle", "audio_in", torch.tensor([3.0, 4.0]))
        while len(tokens) < 2 and time.monotonic() - sent < 5:
            await asyncio.sleep(0.001)
        assert tokens == expected(0, [1, 2, 3, 4])
        runtime.end_input("idle")
        await asyncio.wait_for(reader, 10)

    runtime.conductor.tick = counted
    try:
        asyncio.run(go())
    finally:
        del runtime.conductor.tick
    _wait_free(deployment)


def test_appends_past_max_items_are_refused_before_any_node(deployment):
    async def go():
        events = deployment.backend.generate(GenerateSpec("big", "", [], ["text"], {}))
        reader = asyncio.create_task(anext(events))
        await asyncio.sleep(0.05)
        deployment.runtime.append("big", "audio_in", torch.zeros(60))
        with pytest.raises(RequestError) as err:
            deployment.runtime.append("big", "audio_in", torch.zeros(5))
        assert err.value.field == "audio_in" and err.value.status == 400
        with pytest.raises(RequestError) as err:
            deployment.runtime.append("big", "video", torch.zeros(1))
        assert err.value.field == "video"
        deployment.runtime.end_input("big")
        with pytest.raises(RequestError) as err:
            deployment.runtime.append("big", "audio_in", torch.zeros(1))
        assert err.value.field == "end_input"
        await reader
        async for _ in events:
            pass

    asyncio.run(go())
    _wait_free(deployment)


def test_concurrent_calls_equal_their_solo_runs(deployment):
    calls = {f"c{i}": [[float(i + k) for k in range(3)] for _ in range(4)] for i in range(4)}

    async def go():
        return await asyncio.gather(*[_call(deployment, rid, a, start=i, gap=0.01)
                                      for i, (rid, a) in enumerate(calls.items())])

    results = asyncio.run(go())
    for i, ((rid, appends), (tokens, last, _)) in enumerate(zip(calls.items(), results)):
        assert tokens == expected(i, [s for a in appends for s in a]), rid
        assert last.finish_reason == "stop"
    _wait_free(deployment)


@pytest.mark.parametrize("threads", [None, 2])
def test_requests_prepare_on_the_configured_pool(threads):
    """``prepare_threads``: a request's ``prepare_generate`` runs on the deployment's own pool
    (threads named ``mstar-prepare``), else on asyncio's default executor; the answer is the
    same, and closing the deployment shuts its pool down."""
    d = start(parse_config({"model": "toy_duplex", "max_concurrent_requests": 4, "prepare_threads": threads}),
              in_process=True)
    seen = []
    prepare = d.spec.prepare_generate

    def recording(spec):
        seen.append(threading.current_thread().name)
        return prepare(spec)

    d.spec.prepare_generate = recording
    try:
        assert _one_shot(d, "pooled", [2, 0, 4, 0, 6]) == expected(0, [2, 0, 4, 0, 6])
        assert len(seen) == 1 and seen[0].startswith("mstar-prepare") == (threads is not None)
    finally:
        d.close()
    assert (d.prepare_pool is None) == (threads is None)
    if d.prepare_pool is not None:
        with pytest.raises(RuntimeError):  # shut down with the deployment
            d.prepare_pool.submit(print)
