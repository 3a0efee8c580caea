"""Driving walks with the immutable cursor: order, joins, loops, and a random-tree property."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.graph import Loop, Parallel, Sequential, Step
from mstar.graph.cursor import (
    DONE,
    PENDING,
    RUNNING,
    LoopContext,
    ReadyStep,
    complete,
    is_done,
    mark_pending,
    mark_running,
    ready,
    start,
)
from mstar.graph.walk import iter_steps


def ctx(flags=(), **params) -> LoopContext:
    return LoopContext(frozenset(flags), params)


NO_FLAGS = ctx()


def names(section, cursor) -> list[str]:
    return [r.step.name for r in ready(section, cursor)]


def S(name: str) -> Step:
    return Step("n", name=name)


def run_in_order(section, c: LoopContext = NO_FLAGS, pick=lambda rs: rs[0], max_steps=10_000):
    """Drive the section, completing one ready step at a time (chosen by ``pick``).

    Returns the list of (step name, iteration) in completion order.
    """
    cursor = start(section, c)
    log: list[tuple[str, int]] = []
    for _ in range(max_steps):
        if is_done(cursor):
            return log
        rs = ready(section, cursor)
        assert rs, "a cursor that is not done must have a ready step"
        r = pick(rs)
        cursor = mark_running(section, cursor, r.step)
        cursor = complete(section, cursor, r.step, c)
        log.append((r.step.name, r.iteration))
    raise AssertionError("walk did not terminate")


# --------------------------------------------------------------------------- single step


def test_single_step():
    a = S("a")
    cur = start(a, NO_FLAGS)
    assert cur == PENDING
    assert not is_done(cur)
    assert ready(a, cur) == [ReadyStep(a, 0)]
    cur = mark_running(a, cur, a)
    assert cur == RUNNING
    assert ready(a, cur) == []
    assert not is_done(cur)
    cur = complete(a, cur, a, NO_FLAGS)
    assert cur == DONE
    assert is_done(cur)
    assert ready(a, cur) == []


def test_complete_without_mark_running():
    a = S("a")
    assert complete(a, start(a, NO_FLAGS), a, NO_FLAGS) == DONE


def test_mark_pending_makes_a_running_step_ready_again_in_the_same_iteration():
    a, b = S("a"), S("b")
    loop = Loop(Sequential(a, b), max_iters=3)
    cur = complete(loop, mark_running(loop, start(loop, NO_FLAGS), a), a, NO_FLAGS)
    running = mark_running(loop, cur, b)
    assert ready(loop, running) == []
    assert mark_pending(loop, running, b) == cur  # as before it was dispatched
    assert ready(loop, mark_pending(loop, running, b)) == [ReadyStep(b, 0)]
    assert mark_pending(loop, cur, a) == cur  # a step that is not running is left alone


def test_cursor_functions_do_not_mutate():
    a, b = S("a"), S("b")
    seq = Sequential(a, b)
    c0 = start(seq, NO_FLAGS)
    c1 = mark_running(seq, c0, a)
    c2 = complete(seq, c1, a, NO_FLAGS)
    assert names(seq, c0) == ["a"]
    assert names(seq, c1) == []
    assert names(seq, c2) == ["b"]
    assert c0 != c1 != c2


def test_done_cursor_is_unchanged_by_everything():
    a = S("a")
    seq = Sequential(a)
    assert mark_running(seq, DONE, a) == DONE
    assert complete(seq, DONE, a, NO_FLAGS) == DONE
    assert ready(seq, DONE) == []


# --------------------------------------------------------------------------- sequential


def test_sequential_runs_in_order():
    a, b, c = S("a"), S("b"), S("c")
    seq = Sequential(a, b, c)
    cur = start(seq, NO_FLAGS)
    seen = []
    while not is_done(cur):
        rs = ready(seq, cur)
        assert len(rs) == 1
        seen.append(rs[0].step.name)
        cur = complete(seq, mark_running(seq, cur, rs[0].step), rs[0].step, NO_FLAGS)
    assert seen == ["a", "b", "c"]


def test_nested_sequential_flattens():
    a, b, c, d = S("a"), S("b"), S("c"), S("d")
    seq = Sequential(Sequential(a, Sequential(b)), c, Sequential(d))
    assert [n for n, _ in run_in_order(seq)] == ["a", "b", "c", "d"]


def test_mark_running_removes_step_from_ready():
    a, b = S("a"), S("b")
    seq = Sequential(a, b)
    cur = mark_running(seq, start(seq, NO_FLAGS), a)
    assert ready(seq, cur) == []
    assert not is_done(cur)
    # marking again is harmless
    assert mark_running(seq, cur, a) == cur


def test_mark_running_a_step_that_is_not_current_changes_nothing():
    a, b = S("a"), S("b")
    seq = Sequential(a, b)
    cur = start(seq, NO_FLAGS)
    assert mark_running(seq, cur, b) == cur
    assert names(seq, cur) == ["a"]


def test_completing_a_step_that_is_not_current_leaves_cursor_unchanged():
    a, b, c = S("a"), S("b"), S("c")
    stranger = S("stranger")
    seq = Sequential(a, b, c)
    cur = start(seq, NO_FLAGS)
    assert complete(seq, cur, b, NO_FLAGS) == cur
    assert complete(seq, cur, c, NO_FLAGS) == cur
    assert complete(seq, cur, stranger, NO_FLAGS) == cur
    cur = complete(seq, cur, a, NO_FLAGS)
    # a is behind us now: completing it again is a no-op
    assert complete(seq, cur, a, NO_FLAGS) == cur
    assert names(seq, cur) == ["b"]


def test_steps_are_matched_by_identity_not_by_name():
    a1, a2 = S("a"), S("a")
    seq = Sequential(a1, a2)
    cur = start(seq, NO_FLAGS)
    assert complete(seq, cur, a2, NO_FLAGS) == cur
    cur = complete(seq, cur, a1, NO_FLAGS)
    assert [r.step for r in ready(seq, cur)] == [a2]
    assert ready(seq, cur)[0].step is a2


# --------------------------------------------------------------------------- parallel


@pytest.mark.parametrize("first", ["cond", "uncond"])
def test_parallel_branches_ready_together_and_join_after_both(first):
    cond, uncond, join = S("cond"), S("uncond"), S("join")
    walk = Sequential(Parallel(cond, uncond), join)
    cur = start(walk, NO_FLAGS)
    assert names(walk, cur) == ["cond", "uncond"]
    by_name = {"cond": cond, "uncond": uncond}
    second = "uncond" if first == "cond" else "cond"

    cur = mark_running(walk, cur, cond)
    cur = mark_running(walk, cur, uncond)
    assert ready(walk, cur) == []

    cur = complete(walk, cur, by_name[first], NO_FLAGS)
    assert ready(walk, cur) == []  # join waits for the other branch
    assert not is_done(cur)

    cur = complete(walk, cur, by_name[second], NO_FLAGS)
    assert names(walk, cur) == ["join"]
    cur = complete(walk, cur, join, NO_FLAGS)
    assert is_done(cur)


def test_parallel_mark_one_branch_running_other_stays_ready():
    a, b = S("a"), S("b")
    par = Parallel(a, b)
    cur = mark_running(par, start(par, NO_FLAGS), b)
    assert names(par, cur) == ["a"]
    cur = complete(par, cur, a, NO_FLAGS)
    assert ready(par, cur) == []
    assert not is_done(cur)
    assert is_done(complete(par, cur, b, NO_FLAGS))


def test_parallel_of_sequences_advances_branches_independently():
    a1, a2, b1, b2, j = S("a1"), S("a2"), S("b1"), S("b2"), S("j")
    walk = Sequential(Parallel(Sequential(a1, a2), Sequential(b1, b2)), j)
    cur = start(walk, NO_FLAGS)
    assert names(walk, cur) == ["a1", "b1"]
    cur = complete(walk, cur, a1, NO_FLAGS)
    assert names(walk, cur) == ["a2", "b1"]
    cur = complete(walk, cur, a2, NO_FLAGS)
    assert names(walk, cur) == ["b1"]
    cur = complete(walk, cur, b1, NO_FLAGS)
    assert names(walk, cur) == ["b2"]
    cur = complete(walk, cur, b2, NO_FLAGS)
    assert names(walk, cur) == ["j"]


def test_parallel_of_three_all_orders():
    for order in itertools.permutations(range(3)):
        steps = [S("b0"), S("b1"), S("b2")]
        j = S("j")
        walk = Sequential(Parallel(*steps), j)
        cur = start(walk, NO_FLAGS)
        for k, i in enumerate(order):
            assert sorted(names(walk, cur)) == sorted(f"b{x}" for x in order[k:])
            cur = complete(walk, cur, steps[i], NO_FLAGS)
        assert names(walk, cur) == ["j"]


# --------------------------------------------------------------------------- loops


def test_loop_runs_exactly_max_iters_int():
    d = S("decode")
    loop = Loop(d, max_iters=5)
    log = run_in_order(loop)
    assert log == [("decode", i) for i in range(5)]


def test_loop_runs_exactly_max_iters_param():
    d = S("decode")
    loop = Loop(d, until="stop", max_iters="max_tokens")
    assert run_in_order(loop, ctx(max_tokens=3)) == [("decode", 0), ("decode", 1), ("decode", 2)]
    assert run_in_order(loop, ctx(max_tokens="4")) == [("decode", i) for i in range(4)]  # coerced with int()


def test_loop_param_missing_raises_key_error():
    loop = Loop(S("d"), max_iters="budget")
    with pytest.raises(KeyError):
        start(loop, NO_FLAGS)


def test_loop_max_iters_zero_is_skipped():
    d, after = S("d"), S("after")
    walk = Sequential(Loop(d, max_iters=0), after)
    cur = start(walk, NO_FLAGS)
    assert names(walk, cur) == ["after"]
    assert is_done(start(Loop(d, max_iters=0), NO_FLAGS))
    assert is_done(start(Loop(d, max_iters="n"), ctx(n=0)))


def test_loop_skipped_when_flag_set_on_entry():
    prefill, decode, after = S("prefill"), S("decode"), S("after")
    walk = Sequential(prefill, Loop(decode, until="stop", max_iters=100), after)
    cur = start(walk, NO_FLAGS)
    # prefill hit EOS: the flag is raised when prefill completes
    cur = complete(walk, cur, prefill, ctx({"stop"}))
    assert names(walk, cur) == ["after"]
    assert is_done(start(Loop(decode, until="stop"), ctx({"stop"})))


def test_loop_until_exits_at_iteration_boundary():
    prefill, decode = S("prefill"), S("decode")
    walk = Sequential(prefill, Loop(decode, until="stop", max_iters=100))
    cur = start(walk, NO_FLAGS)
    cur = complete(walk, cur, prefill, NO_FLAGS)
    for i in range(4):
        assert ready(walk, cur) == [ReadyStep(decode, i)]
        cur = complete(walk, cur, decode, NO_FLAGS)
    assert ready(walk, cur) == [ReadyStep(decode, 4)]
    cur = complete(walk, cur, decode, ctx({"stop"}))
    assert is_done(cur)


def test_loop_until_other_flag_does_not_exit():
    d = S("d")
    loop = Loop(d, until="stop", max_iters=3)
    assert len(run_in_order(loop, ctx({"other"}))) == 3


def test_loop_flag_checked_only_at_iteration_boundary():
    a, b = S("a"), S("b")
    loop = Loop(Sequential(a, b), until="stop", max_iters=10)
    cur = start(loop, NO_FLAGS)
    cur = complete(loop, cur, a, ctx({"stop"}))  # raised mid-iteration
    assert ready(loop, cur) == [ReadyStep(b, 0)]  # the iteration finishes
    cur = complete(loop, cur, b, ctx({"stop"}))
    assert is_done(cur)


def test_loop_with_parallel_body_waits_for_both_before_next_iteration():
    a, b = S("a"), S("b")
    loop = Loop(Parallel(a, b), max_iters=2)
    cur = start(loop, NO_FLAGS)
    assert ready(loop, cur) == [ReadyStep(a, 0), ReadyStep(b, 0)]
    cur = complete(loop, cur, b, NO_FLAGS)
    assert ready(loop, cur) == [ReadyStep(a, 0)]
    cur = complete(loop, cur, a, NO_FLAGS)
    assert ready(loop, cur) == [ReadyStep(a, 1), ReadyStep(b, 1)]
    cur = complete(loop, cur, a, NO_FLAGS)
    cur = complete(loop, cur, b, NO_FLAGS)
    assert is_done(cur)


def test_iteration_index_is_zero_outside_loops():
    a, d, z = S("a"), S("d"), S("z")
    walk = Sequential(a, Loop(d, max_iters=2), z)
    assert run_in_order(walk) == [("a", 0), ("d", 0), ("d", 1), ("z", 0)]


def test_chat_walk():
    prefill, decode = S("prefill"), S("decode")
    walk = Sequential(prefill, Loop(decode, until="stop", max_iters="max_tokens"))
    c = ctx(max_tokens=3)
    assert run_in_order(walk, c) == [("prefill", 0), ("decode", 0), ("decode", 1), ("decode", 2)]


def test_nested_loops_iterations_and_counts():
    outer_step, inner_step, tail = S("o"), S("i"), S("t")
    walk = Loop(Sequential(outer_step, Loop(inner_step, max_iters=3), tail), max_iters=2)
    log = run_in_order(walk)
    assert log == [
        ("o", 0), ("i", 0), ("i", 1), ("i", 2), ("t", 0),
        ("o", 1), ("i", 0), ("i", 1), ("i", 2), ("t", 1),
    ]


def test_nested_loop_inner_flag_skips_inner_and_outer_param():
    o, i = S("o"), S("i")
    walk = Loop(Sequential(o, Loop(i, until="stop", max_iters=5)), max_iters="n")
    # 'stop' set: every inner loop is skipped, the outer runs n times
    assert run_in_order(walk, ctx({"stop"}, n=3)) == [("o", 0), ("o", 1), ("o", 2)]


def test_nested_loop_outer_until():
    o, i = S("o"), S("i")
    walk = Loop(Sequential(o, Loop(i, max_iters=2)), until="stop", max_iters=10)
    cur = start(walk, NO_FLAGS)
    cur = complete(walk, cur, o, NO_FLAGS)
    assert ready(walk, cur) == [ReadyStep(i, 0)]
    cur = complete(walk, cur, i, NO_FLAGS)
    assert ready(walk, cur) == [ReadyStep(i, 1)]
    cur = complete(walk, cur, i, ctx({"stop"}))  # inner ends by count, outer checks the flag
    assert is_done(cur)


def test_loop_whose_body_is_an_always_skipped_loop_terminates():
    inner = Loop(S("x"), max_iters=0)
    assert is_done(start(Loop(inner, max_iters=1000), NO_FLAGS))
    assert is_done(start(Loop(Sequential(inner), until="stop"), NO_FLAGS))


# --------------------------------------------------------------------------- property


def _tree(depth: int):
    leaf = st.just(("step",))
    if depth == 0:
        return leaf
    sub = _tree(depth - 1)
    return st.one_of(
        leaf,
        st.lists(sub, min_size=1, max_size=3).map(lambda xs: ("seq", xs)),
        st.lists(sub, min_size=1, max_size=3).map(lambda xs: ("par", xs)),
        st.tuples(sub, st.integers(0, 3), st.booleans(), st.booleans()).map(
            lambda t: ("loop", t[0], t[1], t[2], t[3])
        ),
    )


class Built:
    """A section built from a spec, with bookkeeping about each step."""

    def __init__(self, spec):
        self.counter = 0
        self.expected: dict[Step, int] = {}  # runs when no flag is ever raised
        self.innermost: dict[Step, int | None] = {}  # max_iters of the innermost loop
        self.in_loop: dict[Step, bool] = {}
        self.params: dict[str, int] = {}
        self.seqs: list[list[list[Step]]] = []  # sequentials outside any loop: parts' steps
        self.section = self._build(spec, 1, None, False)

    def _build(self, spec, mult, innermost, in_loop):
        kind = spec[0]
        if kind == "step":
            s = Step("n", name=f"s{self.counter}")
            self.counter += 1
            self.expected[s] = mult
            self.innermost[s] = innermost
            self.in_loop[s] = in_loop
            return s
        if kind == "seq":
            parts = [self._build(x, mult, innermost, in_loop) for x in spec[1]]
            if not in_loop:
                self.seqs.append([list(iter_steps(p)) for p in parts])
            return Sequential(*parts)
        if kind == "par":
            return Parallel(*[self._build(x, mult, innermost, in_loop) for x in spec[1]])
        _, body, n, by_param, with_until = spec
        body_section = self._build(body, mult * n, n, True)
        if by_param:
            name = f"p{len(self.params)}"
            self.params[name] = n
            limit: int | str = name
        else:
            limit = n
        return Loop(body_section, until="stop" if with_until else None, max_iters=limit)


def _drive(built: Built, rng: random.Random, raise_stop_p: float):
    """Dispatch and complete ready steps in random order, several in flight at once.

    Returns per-step completion counts, the iterations seen per step, and the event log.
    """
    section = built.section
    flags: set[str] = set()
    cur = start(section, LoopContext(frozenset(), built.params))
    running: list[Step] = []
    counts: Counter[Step] = Counter()
    iters: dict[Step, list[int]] = {}
    events: list[tuple[str, Step]] = []
    budget = 10 * (sum(built.expected.values()) + 1) + 100
    for _ in range(budget):
        if is_done(cur):
            assert ready(section, cur) == []
            assert not running, "walk finished with steps still running"
            return counts, iters, events
        rs = ready(section, cur)
        ready_steps = [r.step for r in rs]
        assert len(set(map(id, ready_steps))) == len(ready_steps), "a step is ready twice"
        assert not set(ready_steps) & set(running), "a running step is reported ready"
        assert rs or running, "not done, nothing ready, nothing running: stuck"
        if rs and (not running or rng.random() < 0.5):
            r = rng.choice(rs)
            cur = mark_running(section, cur, r.step)
            assert r.step not in [x.step for x in ready(section, cur)]
            running.append(r.step)
            iters.setdefault(r.step, []).append(r.iteration)
            events.append(("dispatch", r.step))
        else:
            s = running.pop(rng.randrange(len(running)))
            if rng.random() < raise_stop_p:
                flags.add("stop")
            cur = complete(section, cur, s, LoopContext(frozenset(flags), built.params))
            counts[s] += 1
            events.append(("complete", s))
    raise AssertionError("walk did not terminate within its step budget")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_tree(3), seed=st.integers(0, 2**32 - 1))
def test_random_walks_without_flags_run_every_step_the_expected_number_of_times(spec, seed):
    built = Built(spec)
    counts, iters, events = _drive(built, random.Random(seed), raise_stop_p=0.0)
    for step, expected in built.expected.items():
        assert counts[step] == expected, step
        if not built.in_loop[step]:
            assert counts[step] == 1
        n = built.innermost[step]
        # the iteration reported is that of the innermost loop, restarting in each outer iteration
        want = [k % n for k in range(expected)] if n else [0] * expected
        assert iters.get(step, []) == want, step
    _check_sequential_order(built, events)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_tree(3), seed=st.integers(0, 2**32 - 1), p=st.sampled_from([0.05, 0.3, 1.0]))
def test_random_walks_with_stop_flags_terminate_and_run_non_loop_steps_once(spec, seed, p):
    built = Built(spec)
    counts, _, events = _drive(built, random.Random(seed), raise_stop_p=p)
    for step, expected in built.expected.items():
        if built.in_loop[step]:
            assert counts[step] <= expected
        else:
            assert counts[step] == 1, step
    _check_sequential_order(built, events)


def _check_sequential_order(built: Built, events):
    """In a Sequential outside loops, every step of a part finishes before any step of
    the next part is dispatched."""
    pos_done: dict[Step, int] = {}
    pos_first: dict[Step, int] = {}
    for k, (kind, s) in enumerate(events):
        if kind == "complete":
            pos_done[s] = k
        else:
            pos_first.setdefault(s, k)
    for parts in built.seqs:
        for before, after in zip(parts, parts[1:]):
            last_done = max((pos_done[s] for s in before if s in pos_done), default=-1)
            first_start = min((pos_first[s] for s in after if s in pos_first), default=len(events))
            assert last_done < first_start
