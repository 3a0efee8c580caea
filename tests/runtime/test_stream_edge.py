"""Stream edges through the real runtime: a producer loop feeding a chunked consumer,
colocated and on two ranks (in-process workers), with toy engines."""

import asyncio
import time

import pytest
import torch

from mstar.config import parse_config
from mstar.contract import GenerateSpec, OutputEvent
from mstar.engine.base import Engine, EngineOutput, StatelessEngine
from mstar.graph import (
    Emit,
    Graph,
    Loop,
    Node,
    Sequential,
    SlidingWindow,
    Step,
    StreamEdge,
    Walk,
)
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest
from mstar.runtime.launch import start

EVENTS: list[tuple[str, str, int]] = []  # (request, what, value): the order things happened in


class Counter(Engine):
    """Emits 0, 1, 2, ... one item per step; raises `stop` after `length` items."""

    def __init__(self):
        self.count: dict[str, int] = {}

    def run(self, items):
        out = []
        for item in items:
            n = self.count.get(item.request_id, 0)
            self.count[item.request_id] = n + 1
            time.sleep(0.01)  # a producer step takes time, as an LLM step does
            EVENTS.append((item.request_id, "produce", n))
            done = n + 1 >= int(item.params["length"])
            flags, finish = (("stop",), "stop") if done else ((), None)
            out.append(EngineOutput({"item": torch.tensor([n * 10 + 1])}, flags, finish))
        return out

    def release(self, request_id):
        self.count.pop(request_id, None)


def consume(op, items):
    """Keeps the chunk's kept items, doubled (stands in for a codec)."""
    outs = []
    for item in items:
        window = item.inputs["codes"]
        kept = window[item.chunk.keep_start:item.chunk.keep_end] * 2
        EVENTS.append((item.request_id, "consume", int(kept.numel())))
        outs.append({"audio": kept})
    return outs


class Collect(OutputStream):
    def __init__(self, request_id):
        self.request_id = request_id
        self.values: list[int] = []

    def feed(self, modality, value):
        EVENTS.append((self.request_id, "frontend", value.numel()))  # the emit reached the API server
        self.values += value.tolist()
        return OutputEvent(modality=modality, data=bytes(value.to(torch.int32).numpy()), token_ids=value.tolist())


@register
class ToyStream(ModelSpec):
    key = "toy_stream"
    tasks = frozenset()  # /generate only

    def graph(self):
        producer = Node("producer", "autoregressive", inputs=("seed",), outputs=("item",), ops=("first", "next"),
                        flags=("stop",))
        codec = Node("codec", "stateless", inputs=("codes",), outputs=("audio",))
        first = Step("producer", "first", reads="seed", writes="item")
        step = Step("producer", "next", reads={"seed": "item"}, writes="item")
        edge = StreamEdge("item", into=Step("codec", reads="codes", writes="audio", emit=Emit("audio", "audio")),
                          policy=SlidingWindow(window=4, stride=2, keep="middle"))
        walk = Walk("speak", Sequential(first, Loop(step, until="stop", max_iters="max_steps")), inputs="seed",
                    streams=[edge])
        return Graph.build([producer, codec], [walk])

    def load_frontend(self):
        pass

    def build_engines(self, nodes, device):
        engines = {"producer": Counter(), "codec": StatelessEngine(consume)}
        return {name: engines[name] for name in nodes}

    def prepare_generate(self, spec):
        length = int(spec.model_kwargs["length"])
        return WalkRequest("speak", {"seed": torch.tensor([0])},
                           {"length": length, "max_steps": length + 5, "request_id": spec.request_id})

    def output_stream(self, request, stop):
        return Collect(request.params["request_id"])


def run_one(deployment, request_id, length):
    async def go():
        events = []
        async for event in deployment.backend.generate(GenerateSpec(request_id, "", [], ["audio"], {"length": length})):
            events.append(event)
        return events

    return asyncio.run(go())


@pytest.fixture(params=["colocated", "two_ranks"])
def deployment(request):
    groups = []
    if request.param == "two_ranks":
        groups = [{"node_names": ["producer"], "ranks": [0]}, {"node_names": ["codec"], "ranks": [1]}]
    d = start(parse_config({"model": "toy_stream", "node_groups": groups}), in_process=True)
    yield d
    d.close()


@pytest.mark.parametrize("length", [1, 3, 4, 7, 12])
def test_stream_items_reach_client_once_and_in_order(deployment, length):
    EVENTS.clear()
    events = run_one(deployment, f"r{length}", length)
    values = [v for e in events for v in e.token_ids]
    assert values == [(n * 10 + 1) * 2 for n in range(length)]
    assert events[-1].finish_reason == "stop"


def test_first_chunk_reaches_client_before_producer_finishes(deployment):
    EVENTS.clear()
    run_one(deployment, "early", 12)
    mine = [(what, value) for rid, what, value in EVENTS if rid == "early"]
    first_at_frontend = next(i for i, (what, _) in enumerate(mine) if what == "frontend")
    last_produce = max(i for i, (what, _) in enumerate(mine) if what == "produce")
    assert first_at_frontend < last_produce


def test_concurrent_streams_do_not_mix(deployment):
    async def go():
        async def one(rid, length):
            out = []
            async for e in deployment.backend.generate(GenerateSpec(rid, "", [], ["audio"], {"length": length})):
                out += e.token_ids
            return out

        return await asyncio.gather(*[one(f"c{i}", 3 + i) for i in range(5)])

    results = asyncio.run(go())
    for i, values in enumerate(results):
        assert values == [(n * 10 + 1) * 2 for n in range(3 + i)]
    assert deployment.runtime.conductor.idle or not deployment.runtime.conductor.live
