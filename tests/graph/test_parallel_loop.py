"""A Parallel inside a Loop, shaped like a guided denoise step: per iteration both branches
are ready together, the join waits for both, and the next iteration starts only after it."""

import itertools

import pytest

from mstar.graph import Loop, Parallel, Sequential, Step
from mstar.graph.cursor import (
    LoopContext,
    ReadyStep,
    complete,
    is_done,
    mark_running,
    ready,
    start,
)

CTX = LoopContext(frozenset(), {"num_steps": 3})


def cfg_walk():
    encode = Step("text_encoder", name="encode")
    cond, uncond, join = Step("dit", "velocity", name="cond"), Step("dit_uncond", "velocity", name="uncond"), \
        Step("dit", "guide", name="guide")
    decode = Step("vae", name="decode")
    walk = Sequential(encode, Loop(Sequential(Parallel(cond, uncond), join), max_iters="num_steps"), decode)
    return walk, encode, cond, uncond, join, decode


@pytest.mark.parametrize("orders", list(itertools.product(["cond first", "uncond first"], repeat=3)))
def test_each_iteration_runs_both_branches_then_the_join(orders):
    walk, encode, cond, uncond, join, decode = cfg_walk()
    cur = complete(walk, start(walk, CTX), encode, CTX)
    for iteration, order in enumerate(orders):
        assert ready(walk, cur) == [ReadyStep(cond, iteration), ReadyStep(uncond, iteration)]
        cur = mark_running(walk, mark_running(walk, cur, cond), uncond)
        first, second = (cond, uncond) if order == "cond first" else (uncond, cond)
        cur = complete(walk, cur, first, CTX)
        assert ready(walk, cur) == []  # the join waits for the other branch
        cur = complete(walk, cur, second, CTX)
        assert ready(walk, cur) == [ReadyStep(join, iteration)]
        cur = complete(walk, mark_running(walk, cur, join), join, CTX)
    assert ready(walk, cur) == [ReadyStep(decode, 0)]
    assert is_done(complete(walk, cur, decode, CTX))


def test_a_branch_dispatched_alone_leaves_the_other_ready_in_the_same_iteration():
    walk, encode, cond, uncond, join, _ = cfg_walk()
    cur = complete(walk, start(walk, CTX), encode, CTX)
    cur = mark_running(walk, cur, cond)  # the other branch's rank was busy
    assert ready(walk, cur) == [ReadyStep(uncond, 0)]
    cur = complete(walk, cur, cond, CTX)
    assert ready(walk, cur) == [ReadyStep(uncond, 0)]
    # a late completion of a step of this iteration changes nothing once it is done
    assert complete(walk, cur, cond, CTX) == cur
    cur = complete(walk, cur, uncond, CTX)
    assert ready(walk, cur) == [ReadyStep(join, 0)]


def test_a_zero_step_loop_goes_straight_to_the_decode():
    walk, encode, *_, decode = cfg_walk()
    ctx = LoopContext(frozenset(), {"num_steps": 0})
    cur = complete(walk, start(walk, ctx), encode, ctx)
    assert ready(walk, cur) == [ReadyStep(decode, 0)]
