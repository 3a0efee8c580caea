"""Nodes and steps: the vocabulary a walk is written in (pure Python, no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class EngineKind(StrEnum):
    """Which engine runs a node; each kind has its own fast path."""

    AUTOREGRESSIVE = "autoregressive"
    STATELESS = "stateless"
    DENOISE = "denoise"
    STREAM = "stream"


class Modality(StrEnum):
    """What an output sent to the client is."""

    TEXT = "text"
    AUDIO = "audio"
    IMAGE = "image"
    VIDEO = "video"
    ACTION = "action"
    LATENT = "latent"
    SCORES = "scores"  # numbers a model reports about its output (Whisper's log probabilities)


@dataclass(frozen=True)
class Node:
    """A component of the model graph, declared by name and ports.

    ``ops`` lists the operations a step may ask of the node (an LLM has ``prefill`` and
    ``decode``; most nodes have one, ``forward``). ``flags`` lists the flags its steps may
    raise for a request (``stop`` for an LLM that hit EOS or its token budget): a Loop
    ``until`` a flag must contain a node that raises it.
    """

    name: str
    kind: EngineKind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ops: tuple[str, ...] = ("forward",)
    flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", EngineKind(self.kind))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "flags", tuple(self.flags))


def _port_map(spec: str | tuple[str, ...] | list[str] | Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """Normalise a reads/writes spec to ((port, variable), ...).

    A bare name means the port and the walk variable share it; a mapping renames.
    """
    if isinstance(spec, str):
        return ((spec, spec),)
    if isinstance(spec, Mapping):
        return tuple((str(port), str(var)) for port, var in spec.items())
    return tuple((name, name) for name in spec)


@dataclass(frozen=True)
class Emit:
    """Send a walk variable to the client as it is produced, tagged with a modality."""

    var: str
    modality: Modality

    def __post_init__(self) -> None:
        object.__setattr__(self, "modality", Modality(self.modality))


@dataclass(frozen=True, eq=False)
class Step:
    """One run of one node operation inside a walk.

    ``reads`` and ``writes`` connect node ports to walk variables (a name, a tuple of
    names, or a {port: variable} mapping). ``emit`` lists written variables that stream to
    the client. Steps compare by identity: the same node may appear in several steps.
    """

    node: str
    op: str = "forward"
    reads: tuple[tuple[str, str], ...] = ()
    writes: tuple[tuple[str, str], ...] = ()
    emit: tuple[Emit, ...] = ()
    name: str = ""

    def __init__(self, node, op="forward", *, reads=(), writes=(), emit=(), name=""):
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "reads", _port_map(reads))
        object.__setattr__(self, "writes", _port_map(writes))
        emits = (emit,) if isinstance(emit, Emit) else tuple(emit)
        object.__setattr__(self, "emit", emits)
        object.__setattr__(self, "name", name or f"{node}.{op}")

    @property
    def read_vars(self) -> tuple[str, ...]:
        return tuple(var for _, var in self.reads)

    @property
    def write_vars(self) -> tuple[str, ...]:
        return tuple(var for _, var in self.writes)

    def __repr__(self) -> str:
        return f"Step({self.name})"

