"""Construction of the Walk Graph primitives: Node, Step, Emit, Sequential, Parallel,
Loop, StreamEdge and Walk (pure Python, no torch)."""

from __future__ import annotations

import dataclasses

import pytest

from mstar.graph import (
    Emit,
    EngineKind,
    FixedFrames,
    Loop,
    Modality,
    Node,
    Parallel,
    Sequential,
    Step,
    StreamEdge,
    Walk,
)
from mstar.graph.walk import iter_steps

# --------------------------------------------------------------------------- Node


def test_node_kind_coerced_from_string():
    node = Node("llm", "autoregressive", ("ids",), ("token",))
    assert node.kind is EngineKind.AUTOREGRESSIVE
    assert isinstance(node.kind, EngineKind)


@pytest.mark.parametrize("kind", list(EngineKind))
def test_node_kind_accepts_every_enum_member_and_its_value(kind):
    assert Node("n", kind, (), ()).kind is kind
    assert Node("n", kind.value, (), ()).kind is kind


def test_node_invalid_kind_raises():
    with pytest.raises(ValueError, match="bogus"):
        Node("n", "bogus", (), ())


def test_node_ports_ops_flags_become_tuples():
    node = Node("llm", EngineKind.AUTOREGRESSIVE, ["ids", "kv"], ["token"], ops=["prefill", "decode"], flags=["stop"])
    assert node.inputs == ("ids", "kv")
    assert node.outputs == ("token",)
    assert node.ops == ("prefill", "decode")
    assert node.flags == ("stop",)
    assert all(isinstance(v, tuple) for v in (node.inputs, node.outputs, node.ops, node.flags))


def test_node_defaults():
    node = Node("vae", EngineKind.STATELESS, ("latents",), ("image",))
    assert node.ops == ("forward",)
    assert node.flags == ()


def test_node_is_frozen_and_compares_by_value():
    a = Node("vae", EngineKind.STATELESS, ("latents",), ("image",))
    b = Node("vae", "stateless", ["latents"], ["image"])
    assert a == b
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.name = "other"  # type: ignore[misc]


# --------------------------------------------------------------------------- Step


def test_step_defaults():
    step = Step("vae")
    assert step.node == "vae"
    assert step.op == "forward"
    assert step.reads == ()
    assert step.writes == ()
    assert step.emit == ()
    assert step.name == "vae.forward"


def test_step_name_default_uses_op_and_explicit_name_wins():
    assert Step("llm", "decode").name == "llm.decode"
    assert Step("llm", "decode", name="talker_decode").name == "talker_decode"


def test_step_reads_writes_bare_string():
    step = Step("llm", "prefill", reads="ids", writes="token")
    assert step.reads == (("ids", "ids"),)
    assert step.writes == (("token", "token"),)
    assert step.read_vars == ("ids",)
    assert step.write_vars == ("token",)


def test_step_reads_writes_tuple_and_list_keep_order():
    step = Step("n", reads=("b", "a", "c"), writes=["y", "x"])
    assert step.reads == (("b", "b"), ("a", "a"), ("c", "c"))
    assert step.writes == (("y", "y"), ("x", "x"))
    assert step.read_vars == ("b", "a", "c")
    assert step.write_vars == ("y", "x")


def test_step_reads_writes_dict_renames_port_to_variable():
    step = Step("dit", reads={"latents": "noisy", "cond": "text_emb"}, writes={"eps": "eps_cond"})
    assert step.reads == (("latents", "noisy"), ("cond", "text_emb"))
    assert step.writes == (("eps", "eps_cond"),)
    # read_vars / write_vars name the walk variables, not the ports
    assert step.read_vars == ("noisy", "text_emb")
    assert step.write_vars == ("eps_cond",)


def test_step_empty_reads_writes():
    step = Step("n", reads=(), writes={})
    assert step.reads == ()
    assert step.writes == ()
    assert step.read_vars == ()
    assert step.write_vars == ()


def test_step_single_emit_is_wrapped_in_tuple():
    e = Emit("token", "text")
    step = Step("llm", "decode", writes="token", emit=e)
    assert step.emit == (e,)


def test_step_emit_sequence_kept_in_order():
    e1, e2 = Emit("audio", Modality.AUDIO), Emit("text", Modality.TEXT)
    step = Step("n", writes=("audio", "text"), emit=[e1, e2])
    assert step.emit == (e1, e2)


def test_steps_compare_by_identity():
    a = Step("llm", "decode", reads="token", writes="token")
    b = Step("llm", "decode", reads="token", writes="token")
    assert a != b
    assert a == a
    assert len({a, b}) == 2  # hashable by identity


def test_step_is_frozen():
    step = Step("n")
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.op = "x"  # type: ignore[misc]


def test_step_repr_names_step():
    assert repr(Step("llm", "prefill")) == "Step(llm.prefill)"
    assert repr(Step("llm", name="x")) == "Step(x)"


# --------------------------------------------------------------------------- Emit


def test_emit_modality_coerced_from_string():
    e = Emit("audio", "audio")
    assert e.modality is Modality.AUDIO
    assert e.var == "audio"


@pytest.mark.parametrize("modality", list(Modality))
def test_emit_accepts_every_modality(modality):
    assert Emit("v", modality.value).modality is modality
    assert Emit("v", modality).modality is modality


def test_emit_invalid_modality_raises():
    with pytest.raises(ValueError, match="smell"):
        Emit("v", "smell")


def test_emit_compares_by_value():
    assert Emit("v", "text") == Emit("v", Modality.TEXT)
    assert Emit("v", "text") != Emit("v", "audio")


# --------------------------------------------------------------------------- composition


def test_sequential_and_parallel_hold_parts_in_order():
    a, b, c = Step("a"), Step("b"), Step("c")
    seq = Sequential(a, b, c)
    par = Parallel(b, a)
    assert seq.parts == (a, b, c)
    assert par.branches == (b, a)
    assert Sequential().parts == ()
    assert Parallel().branches == ()


def test_loop_fields_and_defaults():
    body = Step("llm", "decode")
    loop = Loop(body, until="stop")
    assert loop.body is body
    assert loop.until == "stop"
    assert loop.max_iters is None
    assert Loop(body, max_iters="max_tokens").max_iters == "max_tokens"
    assert Loop(body, max_iters=4).until is None


def test_stream_edge_chunk_port_defaults_to_first_read_port():
    voc = Step("vocoder", reads={"codes": "code_chunk", "spk": "speaker"}, writes="audio")
    policy = FixedFrames(4)
    edge = StreamEdge("codes", voc, policy)
    assert edge.chunk_port == "codes"  # port name, not variable name
    assert edge.policy is policy


def test_stream_edge_explicit_port():
    voc = Step("vocoder", reads=("codes", "spk"), writes="audio")
    assert StreamEdge("codes", voc, FixedFrames(4), port="spk").chunk_port == "spk"


def test_stream_edge_chunk_port_falls_back_to_source_when_no_reads():
    voc = Step("vocoder", writes="audio")
    assert StreamEdge("codes", voc, FixedFrames(4)).chunk_port == "codes"


# --------------------------------------------------------------------------- Walk


def test_walk_inputs_and_outputs_as_str():
    walk = Walk("w", Step("n", reads="x", writes="y"), inputs="x", outputs="y")
    assert walk.inputs == ("x",)
    assert walk.outputs == ("y",)
    assert walk.streams == ()


def test_walk_inputs_and_outputs_as_tuple_or_list():
    walk = Walk("w", Step("n"), inputs=["x", "z"], outputs=("y", "w"))
    assert walk.inputs == ("x", "z")
    assert walk.outputs == ("y", "w")


def test_walk_defaults():
    walk = Walk("w", Step("n"), inputs=())
    assert walk.inputs == ()
    assert walk.outputs == ()
    assert walk.streams == ()


def _tts_walk():
    prefill = Step("llm", "prefill", reads="ids", writes="token", emit=Emit("token", "text"))
    decode = Step("llm", "decode", reads="token", writes="token", emit=Emit("token", "text"))
    encode = Step("enc", reads="x", writes="h")
    other = Step("aux", reads="h", writes="g")
    vocoder = Step("vocoder", reads={"codes": "token"}, writes="audio", emit=Emit("audio", "audio"))
    body = Sequential(
        Parallel(encode, prefill),
        Loop(Sequential(decode), until="stop", max_iters=8),
        other,
    )
    edge = StreamEdge("token", vocoder, FixedFrames(7))
    return Walk("tts", body, inputs=("ids", "x"), outputs="g", streams=[edge]), (
        encode, prefill, decode, other, vocoder,
    )


def test_walk_steps_in_declaration_order_including_stream_consumers():
    walk, (encode, prefill, decode, other, vocoder) = _tts_walk()
    steps = list(walk.steps())
    assert steps == [encode, prefill, decode, other, vocoder]
    assert all(s is e for s, e in zip(steps, [encode, prefill, decode, other, vocoder]))
    assert isinstance(walk.streams, tuple) and len(walk.streams) == 1


def test_walk_emits_in_step_order():
    walk, _ = _tts_walk()
    emits = list(walk.emits())
    assert emits == [Emit("token", "text"), Emit("token", "text"), Emit("audio", "audio")]
    assert [e.modality for e in emits] == [Modality.TEXT, Modality.TEXT, Modality.AUDIO]


def test_walk_single_step_body():
    s = Step("n")
    walk = Walk("w", s, inputs=())
    assert list(walk.steps()) == [s]
    assert list(walk.emits()) == []


def test_iter_steps_rejects_non_sections():
    with pytest.raises(TypeError, match="not a walk section"):
        list(iter_steps(Sequential(Step("a"), "oops")))  # type: ignore[arg-type]
