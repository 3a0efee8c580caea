"""The model graph: nodes plus named walks, validated when a model loads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mstar.graph.nodes import Node, Step
from mstar.graph.walk import Loop, Parallel, Section, Sequential, Walk, iter_steps


class GraphError(ValueError):
    """A model graph that cannot run: raised at load time, naming what is wrong."""


@dataclass(frozen=True)
class Graph:
    nodes: Mapping[str, Node]
    walks: Mapping[str, Walk]

    @classmethod
    def build(cls, nodes: Iterable[Node], walks: Iterable[Walk]) -> Graph:
        node_map: dict[str, Node] = {}
        for node in nodes:
            if node.name in node_map:
                raise GraphError(f"node {node.name!r} is declared twice")
            node_map[node.name] = node
        walk_map: dict[str, Walk] = {}
        for walk in walks:
            if walk.name in walk_map:
                raise GraphError(f"walk {walk.name!r} is declared twice")
            walk_map[walk.name] = walk
        graph = cls(node_map, walk_map)
        graph.validate()
        return graph

    def walk(self, name: str) -> Walk:
        try:
            return self.walks[name]
        except KeyError:
            raise GraphError(f"unknown walk {name!r}; the model declares {sorted(self.walks)}") from None

    def validate(self) -> None:
        if not self.walks:
            raise GraphError("the model declares no walks")
        for walk in self.walks.values():
            _validate_walk(self.nodes, walk)


def _validate_walk(nodes: Mapping[str, Node], walk: Walk) -> None:
    where = f"walk {walk.name!r}"
    seen: set[int] = set()
    names: set[str] = set()
    for step in walk.steps():
        if id(step) in seen:
            raise GraphError(f"{where}: step {step.name!r} appears twice; declare a new Step for each use")
        if step.name in names:
            raise GraphError(f"{where}: two steps are named {step.name!r}; give each a distinct name=")
        seen.add(id(step))
        names.add(step.name)
        _validate_step(nodes, step, where)

    clients = [c.var for c in walk.client_streams]
    for var in clients:
        if clients.count(var) > 1 or var in walk.inputs:
            raise GraphError(f"{where}: client stream {var!r} is declared twice (or is also a plain input)")
    defined = _check_flow(walk.body, set(walk.inputs), where, nodes)
    produced_by_body = defined - set(walk.inputs)
    streamed = set(clients)  # sources a stream edge may take: client streams, then consumers' writes
    for edge in walk.streams:
        if edge.source not in produced_by_body and edge.source not in streamed:
            raise GraphError(f"{where}: stream edge source {edge.source!r} is not written by any step of the walk, "
                             "a client stream or the consumer of an earlier stream edge")
        ports = {port for port, _ in edge.into.reads}
        if edge.chunk_port not in ports:
            raise GraphError(f"{where}: stream edge into {edge.into.name!r} feeds port {edge.chunk_port!r}, "
                             "which the step does not read")
        for port, var in edge.into.reads:
            if port != edge.chunk_port and var not in defined:
                raise GraphError(f"{where}: step {edge.into.name!r} reads {var!r}, which nothing writes before it")
        defined |= set(edge.into.write_vars)
        streamed |= set(edge.into.write_vars)
    fed = {edge.source for edge in walk.streams}
    for var in clients:
        if var not in fed:
            raise GraphError(f"{where}: client stream {var!r} feeds no stream edge")

    for name in walk.outputs:
        if name not in defined:
            raise GraphError(f"{where}: output {name!r} is never written")

    read: set[str] = set(walk.outputs)
    emitted: set[str] = set()
    for step in walk.steps():
        read |= set(step.read_vars)
        emitted |= {e.var for e in step.emit}
    read |= {edge.source for edge in walk.streams}
    for step in walk.steps():
        for var in step.write_vars:
            if var not in read and var not in emitted:
                raise GraphError(f"{where}: step {step.name!r} writes {var!r}, "
                                 "which nothing reads, emits or returns (dangling output)")


def _validate_step(nodes: Mapping[str, Node], step: Step, where: str) -> None:
    node = nodes.get(step.node)
    if node is None:
        raise GraphError(f"{where}: step {step.name!r} uses unknown node {step.node!r}; nodes are {sorted(nodes)}")
    if step.op not in node.ops:
        raise GraphError(f"{where}: node {node.name!r} has no op {step.op!r} (it has {list(node.ops)})")
    for port, _ in step.reads:
        if port not in node.inputs:
            raise GraphError(f"{where}: step {step.name!r} reads port {port!r}, "
                             f"not an input of node {node.name!r} {list(node.inputs)}")
    for port, _ in step.writes:
        if port not in node.outputs:
            raise GraphError(f"{where}: step {step.name!r} writes port {port!r}, "
                             f"not an output of node {node.name!r} {list(node.outputs)}")
    written = set(step.write_vars)
    for emit in step.emit:
        if emit.var not in written:
            raise GraphError(f"{where}: step {step.name!r} emits {emit.var!r}, which it does not write")


def _check_flow(section: Section, defined: set[str], where: str, nodes: Mapping[str, Node]) -> set[str]:
    """Walk the section in execution order; return the variables defined after it."""
    if isinstance(section, Step):
        for var in section.read_vars:
            if var not in defined:
                raise GraphError(f"{where}: step {section.name!r} reads {var!r}, "
                                 "which nothing writes before it (missing input)")
        return defined | set(section.write_vars)
    if isinstance(section, Sequential):
        if not section.parts:
            raise GraphError(f"{where}: empty Sequential")
        for part in section.parts:
            defined = _check_flow(part, defined, where, nodes)
        return defined
    if isinstance(section, Parallel):
        if not section.branches:
            raise GraphError(f"{where}: empty Parallel")
        after = set(defined)
        owners: dict[str, int] = {}
        for i, branch in enumerate(section.branches):
            after |= _check_flow(branch, set(defined), where, nodes)
            # Every variable the branch writes, including ones defined before the
            # Parallel (two branches rewriting a loop-carried variable also race).
            written = {var for step in iter_steps(branch) for var in step.write_vars}
            for var in sorted(written):
                if var in owners:
                    raise GraphError(f"{where}: parallel branches {owners[var]} and {i} both write {var!r}")
                owners[var] = i
        return after
    if isinstance(section, Loop):
        if section.until is None and section.max_iters is None:
            raise GraphError(f"{where}: a Loop needs an exit: give it until= or max_iters=")
        if isinstance(section.max_iters, int) and section.max_iters < 0:
            raise GraphError(f"{where}: Loop max_iters must be >= 0, got {section.max_iters}")
        if section.until is not None and section.max_iters is None:
            raisers = [s.name for s in iter_steps(section.body) if section.until in nodes[s.node].flags]
            if not raisers:
                raise GraphError(
                    f"{where}: Loop until={section.until!r} has no exit: no node in its body raises that flag"
                )
        return _check_flow(section.body, defined, where, nodes)
    raise GraphError(f"{where}: not a walk section: {section!r}")
