"""Progress of a Loop that reports it (a denoising loop): the conductor says "step k of n"
once per finished iteration, whatever the body holds, and never for other loops."""

from __future__ import annotations

import pytest
from conductor_rig import Rig

from mstar.graph import Emit, EngineKind, Graph, Loop, Node, Parallel, Sequential, Step, Walk


def denoise_graph() -> Graph:
    nodes = [
        Node("text", EngineKind.STATELESS, inputs=("prompt",), outputs=("emb",)),
        Node("dit", EngineKind.DENOISE, inputs=("latents", "emb"), outputs=("latents",), ops=("cond", "uncond", "mix"),
             flags=("converged",)),
        Node("vae", EngineKind.STATELESS, inputs=("latents",), outputs=("frames",)),
        Node("llm", EngineKind.AUTOREGRESSIVE, inputs=("tok",), outputs=("tok",), ops=("prefill", "decode"),
             flags=("stop",)),
    ]
    guided = Sequential(  # three steps an iteration: the report is still one
        Parallel(Step("dit", "cond", reads=("latents", "emb"), writes={"latents": "c"}),
                 Step("dit", "uncond", reads=("latents", "emb"), writes={"latents": "u"})),
        Step("dit", "mix", reads={"latents": "c", "emb": "u"}, writes="latents"),
    )
    video = Walk("video", Sequential(
        Step("text", reads="prompt", writes="emb"),
        Loop(guided, until="converged", max_iters="num_steps", progress=True),
        Step("vae", reads="latents", writes="frames", emit=Emit("frames", "video")),
    ), inputs=("prompt", "latents"))
    chat = Walk("chat", Sequential(
        Step("llm", "prefill", reads="tok", writes="tok", emit=Emit("tok", "text")),
        Loop(Step("llm", "decode", reads="tok", writes="tok", emit=Emit("tok", "text")), until="stop",
             max_iters="max_decode_steps"),
    ), inputs="tok")
    return Graph.build(nodes, [video, chat])


GRAPH = denoise_graph()


def test_each_finished_iteration_is_reported_once_in_order() -> None:
    rig = Rig(graph=GRAPH)
    rig.submit("a", "video", num_steps=4)
    rig.submit("b", "video", num_steps=2)
    rig.drain()
    assert [p for p in rig.progress if p[0] == "a"] == [("a", k, 4) for k in range(1, 5)]
    assert [p for p in rig.progress if p[0] == "b"] == [("b", 1, 2), ("b", 2, 2)]
    assert rig.finished["a"].reason == "stop" and rig.finished["b"].reason == "stop"
    rig.assert_quiescent()


def test_a_loop_left_early_reports_the_steps_it_ran() -> None:
    rig = Rig(graph=GRAPH)
    rig.submit("a", "video", num_steps=10)
    rig.drain(lambda item: {"flags": ["converged"]} if item.op == "mix" and item.iteration == 2 else {})
    assert rig.progress == [("a", 1, 10), ("a", 2, 10), ("a", 3, 10)]
    assert [i.node for i in rig.items["a"]][-1] == "vae"  # the walk went on past the loop


def test_loops_without_progress_report_nothing() -> None:
    rig = Rig(graph=GRAPH)
    rig.submit("a", "chat", max_decode_steps=5)
    rig.drain()
    assert rig.progress == []
    assert len(rig.items["a"]) == 6


def test_a_progress_loop_needs_max_iters() -> None:
    with pytest.raises(ValueError, match="max_iters"):
        Loop(Step("dit", "cond"), until="converged", progress=True)
