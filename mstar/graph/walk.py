"""Walk composition: Sequential, Parallel, Loop, StreamEdge and the named Walk."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from mstar.graph.chunking import ChunkPolicy
from mstar.graph.nodes import Emit, Step


@dataclass(frozen=True, eq=False)
class Sequential:
    """Run the parts in order; a later part reads what an earlier one wrote."""

    parts: tuple[Section, ...]

    def __init__(self, *parts: Section):
        object.__setattr__(self, "parts", tuple(parts))


@dataclass(frozen=True, eq=False)
class Parallel:
    """Independent branches that may run at the same time; joined by variable name."""

    branches: tuple[Section, ...]

    def __init__(self, *branches: Section):
        object.__setattr__(self, "branches", tuple(branches))


@dataclass(frozen=True, eq=False)
class Loop:
    """Repeat ``body`` until a step raises the flag ``until`` or ``max_iters`` is reached.

    ``max_iters`` is a number or the name of a per-request walk parameter (e.g. the
    decode budget of a chat request). The flag is checked before every iteration,
    including the first, so a request already done (EOS at prefill) skips the loop.

    ``progress``: each finished iteration is reported to the request's client as "step k
    of n" (a denoising loop, whose output comes only at its end); it needs ``max_iters``.
    """

    body: Section
    until: str | None = None
    max_iters: int | str | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        if self.progress and self.max_iters is None:
            raise ValueError("a Loop that reports progress needs max_iters (the n of 'step k of n')")


@dataclass(frozen=True, eq=False)
class StreamEdge:
    """A cross-partition edge: every value of ``source`` is appended to a stream whose
    chunks (chosen by ``policy``) run ``into`` asynchronously, until the producer ends."""

    source: str
    into: Step
    policy: ChunkPolicy
    port: str = ""  # the port of ``into`` that receives the chunk; default: its first read

    @property
    def chunk_port(self) -> str:
        return self.port or (self.into.reads[0][0] if self.into.reads else self.source)


@dataclass(frozen=True)
class ClientStream:
    """A walk input the client appends to while the request runs (``/generate/ws`` appends,
    then ``end_input``): each append is one item of the stream ``var``, which a stream edge
    feeds to its consumer. ``max_items`` caps the items' total first-dimension length (audio
    samples), a number or the name of a walk parameter; the frontend counts it before the
    first node sees an append. The stream closes on ``end_input``; a stream edge fed by a
    consumer of a closed, drained stream closes in turn (a decode loop ends with its input)."""

    var: str
    max_items: int | str | None = None


Section = Step | Sequential | Parallel | Loop


@dataclass(frozen=True, eq=False)
class Walk:
    """A named path through the graph that one request follows.

    ``inputs`` are the variables the request brings (made by the model's ``prepare``);
    ``outputs`` are variables returned at the end in addition to emitted ones;
    ``client_streams`` are inputs the client appends to while it runs (``ClientStream``).
    A stream edge's source may be written by the body, be a client stream, or be written by
    the consumer of a stream edge declared before it (a chain of asynchronous stages).
    """

    name: str
    body: Section
    inputs: tuple[str, ...]
    outputs: tuple[str, ...] = ()
    streams: tuple[StreamEdge, ...] = field(default_factory=tuple)
    client_streams: tuple[ClientStream, ...] = field(default_factory=tuple)

    def __init__(self, name, body, inputs, outputs=(), streams=(), client_streams=()):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "inputs", (inputs,) if isinstance(inputs, str) else tuple(inputs))
        object.__setattr__(self, "outputs", (outputs,) if isinstance(outputs, str) else tuple(outputs))
        object.__setattr__(self, "streams", tuple(streams))
        object.__setattr__(self, "client_streams", tuple(client_streams))

    def client_stream(self, var: str) -> ClientStream | None:
        return next((c for c in self.client_streams if c.var == var), None)

    def steps(self) -> Iterator[Step]:
        """Every step of the walk, stream consumers included, in declaration order."""
        yield from iter_steps(self.body)
        for edge in self.streams:
            yield edge.into

    def emits(self) -> Iterator[Emit]:
        for step in self.steps():
            yield from step.emit


def iter_steps(section: Section) -> Iterator[Step]:
    if isinstance(section, Step):
        yield section
    elif isinstance(section, Sequential):
        for part in section.parts:
            yield from iter_steps(part)
    elif isinstance(section, Parallel):
        for branch in section.branches:
            yield from iter_steps(branch)
    elif isinstance(section, Loop):
        yield from iter_steps(section.body)
    else:
        raise TypeError(f"not a walk section: {section!r}")
