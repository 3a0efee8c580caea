"""The conductor driving a guided denoise Loop whose branches sit on two ranks (fabricated
results; the rig checks versions, routes and params on every tick)."""

from conductor_rig import Rig

from mstar.graph import (
    Emit,
    EngineKind,
    Graph,
    Loop,
    Node,
    Parallel,
    Sequential,
    Step,
    Walk,
)
from mstar.runtime.placement import NodeGroup, Placement


def cfg_graph() -> Graph:
    nodes = [
        Node("text_encoder", EngineKind.STATELESS, inputs=("ids",), outputs=("text",)),
        Node("dit", EngineKind.DENOISE, inputs=("latents", "text", "v_cond", "v_uncond"),
             outputs=("latents", "velocity"), ops=("velocity", "guide")),
        Node("dit_uncond", EngineKind.DENOISE, inputs=("latents", "text"), outputs=("velocity",), ops=("velocity",)),
        Node("vae", EngineKind.STATELESS, inputs=("latents",), outputs=("image",)),
    ]
    walk = Walk("t2i_guided", Sequential(
        Parallel(Step("text_encoder", reads={"ids": "ids"}, writes="text"),
                 Step("text_encoder", reads={"ids": "negative_ids"}, writes={"text": "negative_text"}, name="neg")),
        Loop(Sequential(
            Parallel(Step("dit", "velocity", reads=("latents", "text"), writes={"velocity": "v_cond"}, name="cond"),
                     Step("dit_uncond", "velocity", reads={"latents": "latents", "text": "negative_text"},
                          writes={"velocity": "v_uncond"}, name="uncond")),
            Step("dit", "guide", reads=("latents", "v_cond", "v_uncond"), writes="latents"),
        ), max_iters="num_steps"),
        Step("vae", reads="latents", writes="image", emit=Emit("image", "image")),
    ), inputs=("ids", "negative_ids", "latents"))
    return Graph.build(nodes, [walk])


GRAPH = cfg_graph()


def placement(uncond_rank: int) -> Placement:
    return Placement(GRAPH, (NodeGroup(("text_encoder", "dit", "vae"), (0,)),
                             NodeGroup(("dit_uncond",), (uncond_rank,))))


def test_branches_on_two_ranks_run_together_each_step_and_exchange_tensors():
    rig = Rig(placement(1), graph=GRAPH)
    rig.submit("a", "t2i_guided", num_steps=3)
    d = rig.tick()
    assert sorted(i.step for i in d.plans[0].items) == ["neg", "text_encoder.forward"]  # one encoder batch
    for iteration in range(3):
        d = rig.step()
        assert [(i.step, i.iteration) for i in d.plans[0].items] == [("cond", iteration)]
        assert [(i.step, i.iteration) for i in d.plans[1].items] == [("uncond", iteration)]
        [uncond] = d.plans[1].items
        assert uncond.send == {"velocity": [0]}  # v_uncond goes back to the guide's rank
        rig.answer(1)  # the unconditional branch finishes first: the guide still waits
        assert not rig.tick().plans
        d = rig.step()
        [guide] = d.plans[0].items
        assert (guide.step, guide.iteration) == ("dit.guide", iteration)
        assert guide.send == {"latents": [1]}  # new latents go out to the other branch
    d = rig.step()
    assert [i.step for i in d.plans[0].items] == ["vae.forward"]
    rig.drain()
    assert rig.finished["a"].reason == "stop" and rig.finished["a"].emitted == 1
    assert ("a", 1) in rig.released


def test_colocated_branches_share_one_plan_and_requests_interleave():
    rig = Rig(placement(0), graph=GRAPH)
    rig.submit("a", "t2i_guided", num_steps=2)
    rig.submit("b", "t2i_guided", num_steps=3)
    rig.tick()
    d = rig.step()
    assert sorted((i.request_id, i.step) for i in d.plans[0].items) == [
        ("a", "cond"), ("a", "uncond"), ("b", "cond"), ("b", "uncond")]
    assert all(not i.send for i in d.plans[0].items)  # nothing leaves the rank
    rig.drain()
    assert {rid: f.reason for rid, f in rig.finished.items()} == {"a": "stop", "b": "stop"}
    assert sum(i.step == "dit.guide" for i in rig.items["b"]) == 3
