"""Several models' graphs as one: each model's nodes and walks renamed under its part's
name (``llm/decoder``, ``llm/chat``), so a many-model deployment places, batches and admits
them all with one conductor and one set of workers, and a node group names a part's node as
``part/node``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from mstar.graph.graph import Graph
from mstar.graph.nodes import Node, Step
from mstar.graph.walk import Loop, Parallel, Section, Sequential, StreamEdge, Walk

SEPARATOR = "/"
"""Between a part's name and its own node, walk or resource name."""


def qualified(part: str, name: str) -> str:
    return f"{part}{SEPARATOR}{name}"


def split_name(name: str) -> tuple[str, str]:
    """``("llm", "chat")`` of ``"llm/chat"``; a name with no part raises ``ValueError``."""
    part, sep, own = name.partition(SEPARATOR)
    if not sep:
        raise ValueError(f"{name!r} names no part (expected part{SEPARATOR}name)")
    return part, own


def compose(graphs: Mapping[str, Graph]) -> Graph:
    """One graph holding every part's graph, its nodes and walks renamed under the part."""
    nodes: list[Node] = []
    walks: list[Walk] = []
    for part, graph in graphs.items():
        if SEPARATOR in part or not part:
            raise ValueError(f"part name {part!r} must be non-empty and hold no {SEPARATOR!r}")
        nodes += [replace(node, name=qualified(part, node.name)) for node in graph.nodes.values()]
        walks += [_walk(part, walk) for walk in graph.walks.values()]
    return Graph.build(nodes, walks)


def _step(part: str, step: Step) -> Step:
    return Step(qualified(part, step.node), step.op, reads=dict(step.reads), writes=dict(step.writes),
                emit=step.emit, name=qualified(part, step.name))


def _section(part: str, section: Section) -> Section:
    if isinstance(section, Step):
        return _step(part, section)
    if isinstance(section, Sequential):
        return Sequential(*(_section(part, s) for s in section.parts))
    if isinstance(section, Parallel):
        return Parallel(*(_section(part, s) for s in section.branches))
    if isinstance(section, Loop):
        return replace(section, body=_section(part, section.body))
    raise TypeError(f"not a walk section: {section!r}")


def _walk(part: str, walk: Walk) -> Walk:
    streams = [StreamEdge(e.source, _step(part, e.into), e.policy, e.port) for e in walk.streams]
    return Walk(qualified(part, walk.name), _section(part, walk.body), walk.inputs, walk.outputs, streams,
                walk.client_streams)
