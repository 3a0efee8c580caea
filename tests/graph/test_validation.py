"""Graph.build validation: every load-time error names its offender; good graphs build."""

from __future__ import annotations

import re

import pytest

from mstar.graph import (
    Emit,
    EngineKind,
    FixedFrames,
    Graph,
    GraphError,
    Loop,
    Modality,
    Node,
    Parallel,
    Sequential,
    SlidingWindow,
    Step,
    StreamEdge,
    Walk,
)

LLM = Node("llm", EngineKind.AUTOREGRESSIVE, ("ids", "token"), ("token",), ops=("prefill", "decode"), flags=("stop",))
ENC = Node("enc", EngineKind.STATELESS, ("x",), ("h",))
DIT = Node("dit", EngineKind.DENOISE, ("latents", "cond"), ("eps",))
MIX = Node("mix", EngineKind.STATELESS, ("a", "b", "latents"), ("latents",))
VAE = Node("vae", EngineKind.STATELESS, ("latents",), ("image",))
VOC = Node("vocoder", EngineKind.STREAM, ("codes", "spk"), ("audio",))
NODES = (LLM, ENC, DIT, MIX, VAE, VOC)


def build(*walks: Walk, nodes=NODES) -> Graph:
    return Graph.build(nodes, walks)


def raises(match: str):
    return pytest.raises(GraphError, match=match)


def chat_walk(name: str = "chat") -> Walk:
    return Walk(
        name,
        Sequential(
            Step("llm", "prefill", reads="ids", writes="token", emit=Emit("token", "text")),
            Loop(
                Step("llm", "decode", reads="token", writes="token", emit=Emit("token", "text")),
                until="stop",
                max_iters="max_tokens",
            ),
        ),
        inputs="ids",
    )


# --------------------------------------------------------------------------- valid graphs


def test_chat_walk_builds():
    walk = chat_walk()
    graph = build(walk)
    assert graph.walk("chat") is walk
    assert set(graph.nodes) == {n.name for n in NODES}
    assert graph.nodes["llm"] is LLM


def test_chat_walk_with_until_only_builds():
    walk = Walk(
        "chat",
        Sequential(
            Step("llm", "prefill", reads="ids", writes="token", emit=Emit("token", "text")),
            Loop(Step("llm", "decode", reads="token", writes="token", emit=Emit("token", "text")), until="stop"),
        ),
        inputs="ids",
    )
    build(walk)


def test_cfg_parallel_join_builds():
    cond = Step("dit", reads={"latents": "latents", "cond": "pos"}, writes={"eps": "eps_pos"}, name="cond")
    uncond = Step("dit", reads={"latents": "latents", "cond": "neg"}, writes={"eps": "eps_neg"}, name="uncond")
    join = Step("mix", reads={"a": "eps_pos", "b": "eps_neg", "latents": "latents"}, writes="latents")
    decode = Step("vae", reads="latents", writes="image", emit=Emit("image", Modality.IMAGE))
    walk = Walk(
        "t2i",
        Sequential(Loop(Sequential(Parallel(cond, uncond), join), max_iters="steps"), decode),
        inputs=("latents", "pos", "neg"),
    )
    graph = build(walk)
    assert list(graph.walk("t2i").steps()) == [cond, uncond, join, decode]


def test_cfg_parallel_with_sequential_branches_builds():
    walk = Walk(
        "t2i",
        Sequential(
            Parallel(
                Sequential(Step("enc", reads={"x": "p"}, writes={"h": "pos"}, name="enc_pos"),
                           Step("dit", reads={"latents": "latents", "cond": "pos"}, writes={"eps": "e1"},
                                name="dit_pos")),
                Sequential(Step("enc", reads={"x": "n"}, writes={"h": "neg"}, name="enc_neg"),
                           Step("dit", reads={"latents": "latents", "cond": "neg"}, writes={"eps": "e2"},
                                name="dit_neg")),
            ),
            Step("mix", reads={"a": "e1", "b": "e2", "latents": "latents"}, writes="latents"),
        ),
        inputs=("latents", "p", "n"),
        outputs="latents",
    )
    build(walk)


def test_tts_walk_with_stream_edge_builds():
    vocoder = Step("vocoder", reads={"codes": "token", "spk": "speaker"}, writes="audio", emit=Emit("audio", "audio"))
    walk = Walk(
        "tts",
        Sequential(
            Step("llm", "prefill", reads="ids", writes="token"),
            Loop(Step("llm", "decode", reads="token", writes="token"), until="stop", max_iters=2048),
        ),
        inputs=("ids", "speaker"),
        streams=[StreamEdge("token", vocoder, SlidingWindow(28, 7))],
    )
    graph = build(walk)
    assert list(graph.walk("tts").emits()) == [Emit("audio", Modality.AUDIO)]


def test_stream_edge_with_explicit_port_builds():
    vocoder = Step("vocoder", reads={"spk": "speaker", "codes": "token"}, writes="audio", emit=Emit("audio", "audio"))
    walk = Walk(
        "tts",
        Sequential(
            Step("llm", "prefill", reads="ids", writes="token"),
            Loop(Step("llm", "decode", reads="token", writes="token"), until="stop"),
        ),
        inputs=("ids", "speaker"),
        streams=[StreamEdge("token", vocoder, FixedFrames(4), port="codes")],
    )
    build(walk)


def test_stream_consumer_output_can_be_walk_output():
    vocoder = Step("vocoder", reads={"codes": "token"}, writes="audio")
    walk = Walk(
        "tts",
        Sequential(
            Step("llm", "prefill", reads="ids", writes="token"),
            Loop(Step("llm", "decode", reads="token", writes="token"), until="stop"),
        ),
        inputs="ids",
        outputs="audio",
        streams=[StreamEdge("token", vocoder, FixedFrames(4))],
    )
    build(walk)


def test_several_walks_share_nodes():
    image = Walk(
        "caption",
        Sequential(
            Step("enc", writes={"h": "ids"}, reads="x"),
            Step("llm", "prefill", reads="ids", writes="token", emit=Emit("token", "text")),
            Loop(Step("llm", "decode", reads="token", writes="token", emit=Emit("token", "text")), until="stop"),
        ),
        inputs="x",
    )
    graph = build(chat_walk(), image)
    assert sorted(graph.walks) == ["caption", "chat"]


def test_output_returned_counts_as_use():
    walk = Walk("enc", Step("enc", reads="x", writes="h"), inputs="x", outputs="h")
    build(walk)


def test_input_read_by_first_step_needs_no_writer():
    build(Walk("enc", Step("enc", reads="x", writes="h", emit=Emit("h", "latent")), inputs=("x",)))


def test_loop_until_without_raiser_but_with_max_iters_is_allowed():
    loop = Loop(Step("enc", reads="x", writes={"h": "x"}), until="stop", max_iters=3)
    walk = Walk("w", loop, inputs="x", outputs="x")
    build(walk)


def test_max_iters_zero_is_allowed():
    walk = Walk("w", Loop(Step("enc", reads="x", writes={"h": "x"}), max_iters=0), inputs="x", outputs="x")
    build(walk)


# --------------------------------------------------------------------------- Graph.walk


def test_graph_walk_unknown_name():
    graph = build(chat_walk())
    with raises(r"unknown walk 'speak'.*\['chat'\]"):
        graph.walk("speak")


def test_graph_walk_error_is_a_value_error():
    graph = build(chat_walk())
    with pytest.raises(ValueError):
        graph.walk("nope")


# --------------------------------------------------------------------------- build-level errors


def test_duplicate_node():
    with raises(r"node 'llm' is declared twice"):
        Graph.build([LLM, ENC, Node("llm", "stateless", (), ())], [chat_walk()])


def test_duplicate_walk():
    with raises(r"walk 'chat' is declared twice"):
        build(chat_walk("chat"), chat_walk("chat"))


def test_no_walks():
    with raises(r"declares no walks"):
        Graph.build(NODES, [])


# --------------------------------------------------------------------------- step errors


def test_unknown_node():
    walk = Walk("w", Step("clip", reads="x", writes="h", name="clip_enc"), inputs="x", outputs="h")
    with raises(r"walk 'w': step 'clip_enc' uses unknown node 'clip'") as exc:
        build(walk)
    assert "'enc'" in str(exc.value)  # lists the nodes that exist


def test_unknown_op():
    walk = Walk("w", Step("llm", "generate", reads="ids", writes="token"), inputs="ids", outputs="token")
    with raises(r"walk 'w': node 'llm' has no op 'generate'.*prefill.*decode"):
        build(walk)


def test_read_port_not_an_input_of_node():
    walk = Walk("w", Step("enc", reads={"pixels": "x"}, writes="h"), inputs="x", outputs="h")
    with raises(r"walk 'w': step 'enc.forward' reads port 'pixels', not an input of node 'enc'"):
        build(walk)


def test_write_port_not_an_output_of_node():
    walk = Walk("w", Step("enc", reads="x", writes={"hidden": "h"}), inputs="x", outputs="h")
    with raises(r"walk 'w': step 'enc.forward' writes port 'hidden', not an output of node 'enc'"):
        build(walk)


def test_output_port_used_as_read_is_rejected():
    walk = Walk("w", Step("enc", reads="h", writes="h"), inputs="h", outputs="h")
    with raises(r"reads port 'h', not an input of node 'enc'"):
        build(walk)


def test_emit_of_unwritten_variable():
    walk = Walk("w", Step("enc", reads="x", writes="h", emit=Emit("x", "text"), name="e"), inputs="x", outputs="h")
    with raises(r"walk 'w': step 'e' emits 'x', which it does not write"):
        build(walk)


def test_emit_uses_variable_not_port_name():
    # writes port h into variable y; emitting 'h' is emitting an unwritten variable
    walk = Walk("w", Step("enc", reads="x", writes={"h": "y"}, emit=Emit("h", "text")), inputs="x", outputs="y")
    with raises(r"emits 'h'"):
        build(walk)


def test_same_step_object_twice():
    s = Step("enc", reads="x", writes={"h": "x"}, name="again")
    walk = Walk("w", Sequential(s, s), inputs="x", outputs="x")
    with raises(r"walk 'w': step 'again' appears twice"):
        build(walk)


def test_same_step_object_in_body_and_stream():
    voc = Step("vocoder", reads={"codes": "token"}, writes="audio", name="voc")
    walk = Walk(
        "w",
        Sequential(Step("llm", "prefill", reads="ids", writes="token"),
                   Step("llm", "decode", reads="token", writes="token")),
        inputs="ids",
        outputs="audio",
        streams=[StreamEdge("token", voc, FixedFrames(2)), StreamEdge("token", voc, FixedFrames(2))],
    )
    with raises(r"step 'voc' appears twice"):
        build(walk)


def test_same_node_in_distinct_steps_is_fine():
    walk = Walk(
        "w",
        Sequential(Step("enc", reads="x", writes={"h": "x"}, name="e1"),
                   Step("enc", reads="x", writes={"h": "x"}, name="e2")),
        inputs="x",
        outputs="x",
    )
    build(walk)


def test_two_distinct_steps_with_the_same_name():
    walk = Walk(
        "w",
        Sequential(Step("enc", reads="x", writes={"h": "x"}), Step("enc", reads="x", writes={"h": "x"})),
        inputs="x",
        outputs="x",
    )
    with raises(r"walk 'w': two steps are named 'enc.forward'"):
        build(walk)


def test_step_names_only_need_to_be_unique_within_a_walk():
    a = Walk("a", Step("enc", reads="x", writes="h"), inputs="x", outputs="h")
    b = Walk("b", Step("enc", reads="x", writes="h"), inputs="x", outputs="h")
    build(a, b)


def test_errors_name_the_walk_among_several():
    bad = Walk("bad", Step("nope"), inputs=())
    with raises(r"walk 'bad'"):
        build(chat_walk(), bad)


# --------------------------------------------------------------------------- dataflow errors


def test_missing_input_read_before_written():
    walk = Walk(
        "w",
        Sequential(
            Step("llm", "decode", reads="token", writes="token", name="dec"),
            Step("llm", "prefill", reads="ids", writes="token"),
        ),
        inputs="ids",
        outputs="token",
    )
    with raises(r"walk 'w': step 'dec' reads 'token', which nothing writes before it \(missing input\)"):
        build(walk)


def test_missing_input_not_a_walk_input():
    walk = Walk("w", Step("enc", reads={"x": "pixels"}, writes="h"), inputs="x", outputs="h")
    with raises(r"step 'enc.forward' reads 'pixels', which nothing writes before it"):
        build(walk)


def test_parallel_branch_cannot_read_sibling_output():
    walk = Walk(
        "w",
        Sequential(
            Parallel(
                Step("enc", reads="x", writes="h", name="a"),
                Step("vae", reads={"latents": "h"}, writes="image", name="b"),
            ),
        ),
        inputs="x",
        outputs=("h", "image"),
    )
    with raises(r"step 'b' reads 'h', which nothing writes before it"):
        build(walk)


def test_dangling_output():
    walk = Walk(
        "w",
        Sequential(Step("enc", reads="x", writes="h", name="e"), Step("vae", reads={"latents": "x"}, writes="image")),
        inputs="x",
        outputs="image",
    )
    with raises(r"walk 'w': step 'e' writes 'h', which nothing reads, emits or returns \(dangling output\)"):
        build(walk)


def test_emitted_output_is_not_dangling():
    build(Walk("w", Step("enc", reads="x", writes="h", emit=Emit("h", "latent")), inputs="x"))


def test_stream_source_is_not_dangling():
    voc = Step("vocoder", reads={"codes": "h"}, writes="audio", emit=Emit("audio", "audio"))
    build(Walk("w", Step("enc", reads="x", writes="h"), inputs="x", streams=[StreamEdge("h", voc, FixedFrames(1))]))


def test_dangling_stream_consumer_output():
    voc = Step("vocoder", reads={"codes": "h"}, writes="audio", name="voc")
    walk = Walk("w", Step("enc", reads="x", writes="h"), inputs="x", streams=[StreamEdge("h", voc, FixedFrames(1))])
    with raises(r"step 'voc' writes 'audio'.*dangling output"):
        build(walk)


def test_undeclared_walk_output():
    walk = Walk("w", Step("enc", reads="x", writes="h"), inputs="x", outputs=("h", "image"))
    with raises(r"walk 'w': output 'image' is never written"):
        build(walk)


def test_walk_input_listed_as_output_is_allowed():
    build(Walk("w", Step("enc", reads="x", writes="h"), inputs="x", outputs=("h", "x")))


# --------------------------------------------------------------------------- parallel


def test_parallel_branches_write_same_variable():
    walk = Walk(
        "w",
        Sequential(
            Parallel(
                Step("enc", reads="x", writes="h", name="a"),
                Step("enc", reads="x", writes="h", name="b"),
            ),
        ),
        inputs="x",
        outputs="h",
    )
    with raises(r"walk 'w': parallel branches 0 and 1 both write 'h'"):
        build(walk)


def test_parallel_third_branch_collides_with_first():
    walk = Walk(
        "w",
        Parallel(
            Step("enc", reads="x", writes={"h": "a"}, name="s0"),
            Step("enc", reads="x", writes={"h": "b"}, name="s1"),
            Sequential(
                Step("enc", reads="x", writes={"h": "c"}, name="s2a"),
                Step("enc", reads={"x": "c"}, writes={"h": "a"}, name="s2b"),
            ),
        ),
        inputs="x",
        outputs=("a", "b"),
    )
    with raises(r"parallel branches 0 and 2 both write 'a'"):
        build(walk)


def test_parallel_branches_overwrite_same_existing_variable():
    # Both branches rewrite the loop-carried 'latents' (already defined before the
    # Parallel): a write/write race, which must be rejected just like a fresh variable.
    walk = Walk(
        "w",
        Loop(
            Parallel(
                Step("mix", reads=("a", "b", "latents"), writes="latents", name="left"),
                Step("mix", reads=("a", "b", "latents"), writes="latents", name="right"),
            ),
            max_iters=4,
        ),
        inputs=("a", "b", "latents"),
        outputs="latents",
    )
    with raises(r"parallel branches 0 and 1 both write 'latents'"):
        build(walk)


def test_empty_parallel_and_sequential():
    with raises(r"walk 'w': empty Parallel"):
        build(Walk("w", Sequential(Step("enc", reads="x", writes="h"), Parallel()), inputs="x", outputs="h"))
    with raises(r"walk 'w': empty Sequential"):
        build(Walk("w", Sequential(Step("enc", reads="x", writes="h"), Sequential()), inputs="x", outputs="h"))


# --------------------------------------------------------------------------- loops


def test_loop_without_until_or_max_iters():
    walk = Walk("w", Loop(Step("enc", reads="x", writes={"h": "x"})), inputs="x", outputs="x")
    with raises(r"walk 'w': a Loop needs an exit: give it until= or max_iters="):
        build(walk)


def test_loop_until_flag_no_body_node_raises():
    walk = Walk("w", Loop(Step("enc", reads="x", writes={"h": "x"}), until="stop"), inputs="x", outputs="x")
    with raises(r"walk 'w': Loop until='stop' has no exit: no node in its body raises that flag"):
        build(walk)


def test_loop_until_flag_raised_only_outside_body():
    # prefill raises 'stop' but sits outside the loop; the body never can.
    walk = Walk(
        "w",
        Sequential(
            Step("llm", "prefill", reads="ids", writes="token"),
            Loop(Step("enc", reads={"x": "token"}, writes={"h": "token"}), until="stop"),
        ),
        inputs="ids",
        outputs="token",
    )
    with raises(r"until='stop'"):
        build(walk)


def test_loop_until_unknown_flag():
    walk = Walk(
        "w",
        Sequential(
            Step("llm", "prefill", reads="ids", writes="token"),
            Loop(Step("llm", "decode", reads="token", writes="token"), until="eos"),
        ),
        inputs="ids",
        outputs="token",
    )
    with raises(r"Loop until='eos' has no exit"):
        build(walk)


def test_nested_loop_raiser_counts_for_outer_loop():
    walk = Walk(
        "w",
        Sequential(
            Step("llm", "prefill", reads="ids", writes="token"),
            Loop(Loop(Step("llm", "decode", reads="token", writes="token"), max_iters=2), until="stop"),
        ),
        inputs="ids",
        outputs="token",
    )
    build(walk)


@pytest.mark.parametrize("n", [-1, -7])
def test_negative_max_iters(n):
    walk = Walk("w", Loop(Step("enc", reads="x", writes={"h": "x"}), max_iters=n), inputs="x", outputs="x")
    with raises(rf"walk 'w': Loop max_iters must be >= 0, got {n}"):
        build(walk)


def test_loop_body_errors_are_found():
    walk = Walk(
        "w",
        Sequential(
            Step("llm", "prefill", reads="ids", writes="token"),
            Loop(Step("llm", "decode", reads={"token": "tok"}, writes="token", name="dec"), until="stop"),
        ),
        inputs="ids",
        outputs="token",
    )
    with raises(r"step 'dec' reads 'tok'"):
        build(walk)


# --------------------------------------------------------------------------- streams


def _prefill_decode():
    return Sequential(
        Step("llm", "prefill", reads="ids", writes="token"),
        Loop(Step("llm", "decode", reads="token", writes="token"), until="stop"),
    )


def test_stream_source_never_written():
    voc = Step("vocoder", reads={"codes": "codes"}, writes="audio", emit=Emit("audio", "audio"))
    walk = Walk("w", _prefill_decode(), inputs="ids", outputs="token",
                streams=[StreamEdge("codes", voc, FixedFrames(4))])
    with raises(r"walk 'w': stream edge source 'codes' is not written by any step of the walk"):
        build(walk)


def test_stream_source_that_is_only_a_walk_input_is_rejected():
    voc = Step("vocoder", reads={"codes": "ids"}, writes="audio", emit=Emit("audio", "audio"))
    walk = Walk("w", _prefill_decode(), inputs="ids", outputs="token", streams=[StreamEdge("ids", voc, FixedFrames(4))])
    with raises(r"stream edge source 'ids' is not written"):
        build(walk)


def test_stream_port_not_read_by_consumer():
    voc = Step("vocoder", reads={"codes": "token"}, writes="audio", emit=Emit("audio", "audio"), name="voc")
    walk = Walk("w", _prefill_decode(), inputs="ids", streams=[StreamEdge("token", voc, FixedFrames(4), port="spk")])
    with raises(r"walk 'w': stream edge into 'voc' feeds port 'spk', which the step does not read"):
        build(walk)


def test_stream_consumer_without_reads():
    voc = Step("vocoder", writes="audio", emit=Emit("audio", "audio"), name="voc")
    walk = Walk("w", _prefill_decode(), inputs="ids", outputs="token",
                streams=[StreamEdge("token", voc, FixedFrames(4))])
    with raises(r"stream edge into 'voc' feeds port 'token', which the step does not read"):
        build(walk)


def test_stream_consumer_other_read_missing():
    voc = Step("vocoder", reads={"codes": "token", "spk": "speaker"}, writes="audio", emit=Emit("audio", "audio"),
               name="voc")
    walk = Walk("w", _prefill_decode(), inputs="ids", streams=[StreamEdge("token", voc, FixedFrames(4))])
    with raises(r"walk 'w': step 'voc' reads 'speaker', which nothing writes before it"):
        build(walk)


def test_stream_consumer_unknown_node():
    voc = Step("codec", reads={"codes": "token"}, writes="audio", name="voc")
    walk = Walk("w", _prefill_decode(), inputs="ids", outputs="audio",
                streams=[StreamEdge("token", voc, FixedFrames(4))])
    with raises(r"step 'voc' uses unknown node 'codec'"):
        build(walk)


def test_error_messages_are_graph_errors_and_value_errors():
    walk = Walk("w", Loop(Step("enc", reads="x", writes={"h": "x"})), inputs="x", outputs="x")
    with pytest.raises(ValueError) as exc:
        build(walk)
    assert type(exc.value) is GraphError
    assert re.search("walk 'w'", str(exc.value))
