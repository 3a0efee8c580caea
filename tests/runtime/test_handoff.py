"""Events from the runtime's threads to asyncio consumers: one wake-up per batch, every
waiting event taken at once, text deltas that waited together joined."""

import asyncio
import threading

from mstar.contract import OutputEvent
from mstar.runtime.backend import joined
from mstar.runtime.handoff import AsyncSink, Mailbox


def test_events_posted_from_a_thread_reach_their_sinks_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        sinks = [AsyncSink(loop) for _ in range(3)]
        assert len({id(s.mailbox) for s in sinks}) == 1  # one mailbox per loop

        def produce():
            for i in range(50):
                for k, sink in enumerate(sinks):
                    sink(OutputEvent(text=f"{k}:{i} "))
            for sink in sinks:
                sink(None)

        thread = threading.Thread(target=produce)
        thread.start()
        texts = []
        for sink in sinks:
            got = []
            while None not in got:
                got += await sink.take()
            texts.append("".join(e.text for e in got if e is not None))
        thread.join()
        return texts

    texts = asyncio.run(main())
    assert texts == ["".join(f"{k}:{i} " for i in range(50)) for k in range(3)]


def test_one_wake_up_delivers_everything_posted_meanwhile():
    async def main():
        loop = asyncio.get_running_loop()
        sink = AsyncSink(loop)
        wakes = []
        deliver = sink.mailbox._deliver
        sink.mailbox._deliver = lambda: (wakes.append(1), deliver())
        threading.Thread(target=lambda: [sink(OutputEvent(text=str(i))) for i in range(64)]).start()
        events = []
        while len(events) < 64:
            events += await sink.take()
        return wakes, events

    wakes, events = asyncio.run(main())
    assert [e.text for e in events] == [str(i) for i in range(64)]
    assert len(wakes) < 64


def test_posting_to_a_closed_loop_is_dropped():
    loop = asyncio.new_event_loop()
    sink = AsyncSink(loop)
    loop.close()
    sink(OutputEvent(text="late"))  # must not raise into the runtime's threads
    assert Mailbox.of(loop) is sink.mailbox


def test_joined_merges_runs_of_text_deltas_only():
    a = OutputEvent(text="a", token_ids=[1], completion_tokens=1, prompt_tokens=3)
    b = OutputEvent(text="", token_ids=[2], completion_tokens=2, prompt_tokens=3)
    c = OutputEvent(text="c", token_ids=[3], completion_tokens=3, prompt_tokens=3)
    audio = OutputEvent(modality="audio", data=b"x")
    end = OutputEvent(text="!", finish_reason="stop", completion_tokens=3)
    out = joined([a, b, c, audio, audio, end, None])
    assert [e and (e.text, e.token_ids, e.completion_tokens) for e in out[:1]] == [("ac", [1, 2, 3], 3)]
    assert out[1:] == [audio, audio, end, None]
    assert out[0].prompt_tokens == 3
    assert joined([a]) == [a]
