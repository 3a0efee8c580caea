"""Composing several models' graphs into one (``mstar.graph.compose``): every node, step and
walk is renamed under its part, the walks keep their shape, and the result is validated."""

from __future__ import annotations

import pytest

from mstar.graph import Emit, Graph, GraphError, Loop, Node, Sequential, SlidingWindow, Step, StreamEdge, Walk
from mstar.graph.compose import compose, qualified, split_name


def talker() -> Graph:
    llm = Node("llm", "autoregressive", ("ids", "token"), ("token",), ops=("prefill", "decode"), flags=("stop",))
    codec = Node("codec", "stream", ("codes",), ("audio",))
    body = Sequential(Step("llm", "prefill", reads={"ids": "ids"}, writes="token"),
                      Loop(Step("llm", "decode", reads="token", writes="token"), until="stop", max_iters=8))
    audio = StreamEdge("token", Step("codec", reads="codes", writes="audio", emit=Emit("audio", "audio")),
                       SlidingWindow(window=4, stride=2))
    return Graph.build([llm, codec], [Walk("tts", body, inputs="ids", streams=[audio])])


def encoder() -> Graph:
    enc = Node("llm", "stateless", ("x",), ("h",))  # the same node name as the talker's: parts keep them apart
    return Graph.build([enc], [Walk("encode", Step("llm", reads="x", writes="h", emit=Emit("h", "latent")),
                                    inputs="x")])


def test_names_are_qualified_by_part():
    graph = compose({"voice": talker(), "enc": encoder()})
    assert list(graph.nodes) == ["voice/llm", "voice/codec", "enc/llm"]
    assert list(graph.walks) == ["voice/tts", "enc/encode"]
    assert graph.nodes["enc/llm"].kind == "stateless" and graph.nodes["voice/llm"].flags == ("stop",)
    steps = list(graph.walks["voice/tts"].steps())
    assert [s.node for s in steps] == ["voice/llm", "voice/llm", "voice/codec"]
    assert [s.name for s in steps] == ["voice/llm.prefill", "voice/llm.decode", "voice/codec.forward"]


def test_walks_keep_their_shape():
    original, composed = talker().walks["tts"], compose({"voice": talker()}).walks["voice/tts"]
    assert composed.inputs == original.inputs and composed.outputs == original.outputs
    loop = composed.body.parts[1]
    assert isinstance(loop, Loop) and (loop.until, loop.max_iters) == ("stop", 8)
    for ours, theirs in zip(composed.steps(), original.steps(), strict=True):
        assert (ours.op, ours.reads, ours.writes, ours.emit) == (theirs.op, theirs.reads, theirs.writes, theirs.emit)
    edge, edge0 = composed.streams[0], original.streams[0]
    assert (edge.source, edge.policy, edge.chunk_port) == (edge0.source, edge0.policy, edge0.chunk_port)


def test_part_names_are_checked():
    with pytest.raises(ValueError, match="part name 'a/b'"):
        compose({"a/b": encoder()})
    with pytest.raises(ValueError, match="part name ''"):
        compose({"": encoder()})


def test_the_composed_graph_is_validated():
    broken = Graph(nodes={}, walks=encoder().walks)  # a walk whose node is missing, unvalidated
    with pytest.raises(GraphError, match="unknown node 'enc/llm'"):
        compose({"enc": broken})


def test_qualified_names_split_back():
    assert split_name(qualified("llm", "kv_pages")) == ("llm", "kv_pages")
    assert split_name("tts/piper/x") == ("tts", "piper/x")
    with pytest.raises(ValueError, match="names no part"):
        split_name("kv_pages")


def test_a_denoising_loop_keeps_its_progress_report():
    dit = Node("dit", "denoise", ("x",), ("x",), ops=("step",))
    walk = Walk("paint", Loop(Step("dit", "step", reads="x", writes="x", emit=Emit("x", "image")),
                              max_iters="num_steps", progress=True), inputs="x")
    loop = compose({"art": Graph.build([dit], [walk])}).walks["art/paint"].body
    assert isinstance(loop, Loop) and loop.progress and loop.max_iters == "num_steps"
