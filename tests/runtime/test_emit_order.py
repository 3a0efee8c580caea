"""Outputs reach the frontend straight from the worker ranks, so two ranks' outputs of one
request (a prefill rank's first token, the decode rank's next ones) may arrive out of
order; the runtime delivers them in the order their steps were dispatched, and an output
that will never come (a silent port, a failed step) stops holding back the ones after it."""

from types import SimpleNamespace

from mstar.runtime.protocol import ItemResult, StepResult, VarRef
from mstar.runtime.runtime import Runtime, _Tracked


class Record:
    """An output stream that keeps every value it is fed."""

    stopped = False
    media_seconds = None  # text-like: no media clock

    def __init__(self) -> None:
        self.values: list[int] = []

    def feed(self, modality, value):
        self.values.append(value)
        return None


def rig() -> tuple[Runtime, _Tracked]:
    runtime = Runtime.__new__(Runtime)  # only the frontend's bookkeeping: no conductor, no threads
    tracked = _Tracked(stream=Record(), sink=lambda event: None, prompt_tokens=0)
    runtime.tracked = {"r": tracked}
    return runtime, tracked


def dispatch(runtime: Runtime, step: str, version: int) -> None:
    item = SimpleNamespace(request_id="r", step=step, emit={"token": "text"},
                           writes={"token": VarRef("token", version)})
    runtime._expect_emits(SimpleNamespace(items=[item]))


def arrive(runtime: Runtime, tracked: _Tracked, version: int) -> None:
    with tracked.delivering:
        runtime._arrived("r", tracked, version, "text", version)


def test_a_later_step_output_waits_for_the_earlier_one():
    runtime, tracked = rig()
    dispatch(runtime, "llm_prefill", 1)
    dispatch(runtime, "llm.decode", 2)
    dispatch(runtime, "llm.decode2", 3)
    arrive(runtime, tracked, 3)
    arrive(runtime, tracked, 2)
    assert tracked.stream.values == []  # both held: the prefill's token is still on its way
    arrive(runtime, tracked, 1)
    assert tracked.stream.values == [1, 2, 3] and not tracked.held and not tracked.order


def test_outputs_in_order_pass_straight_through():
    runtime, tracked = rig()
    for version in (1, 2, 3):
        dispatch(runtime, f"s{version}", version)
        arrive(runtime, tracked, version)
        assert tracked.stream.values == list(range(1, version + 1))


def test_a_silent_or_failed_step_releases_what_waits_behind_it():
    runtime, tracked = rig()
    dispatch(runtime, "a", 1)
    dispatch(runtime, "b", 2)
    dispatch(runtime, "c", 3)
    arrive(runtime, tracked, 3)
    runtime._settle_emits(StepResult(0, 1, [ItemResult("r", "a", silent=["token"])]))
    assert tracked.stream.values == []  # "b" may still come
    runtime._settle_emits(StepResult(0, 2, [ItemResult("r", "b", error="boom")]))
    assert tracked.stream.values == [3] and not tracked.order


def test_an_output_it_did_not_expect_is_delivered_at_once():
    runtime, tracked = rig()
    dispatch(runtime, "a", 5)
    arrive(runtime, tracked, 9)  # not registered (e.g. dispatched before tracking began)
    assert tracked.stream.values == [9] and tracked.order == [5]
