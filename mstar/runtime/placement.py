"""Placement: which worker rank runs each node, optionally per walk, and where tensors go.

Built from the deployment YAML's ``node_groups``; the routing table derived from it is
static per (walk, step), so the conductor computes it once at load time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.graph import Graph, Step, Walk


@dataclass(frozen=True)
class NodeGroup:
    node_names: tuple[str, ...]
    ranks: tuple[int, ...]
    graph_walks: tuple[str, ...] = ()  # empty: every walk
    tp_size: int = 1


@dataclass
class Placement:
    """Maps (walk, node) to the rank whose worker owns it."""

    graph: Graph
    groups: tuple[NodeGroup, ...]
    _owner: dict[tuple[str, str], int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        for walk in self.graph.walks.values():
            for node in {step.node for step in walk.steps()}:
                self._owner[(walk.name, node)] = self._find(walk.name, node)

    def _find(self, walk: str, node: str) -> int:
        specific = [g for g in self.groups if node in g.node_names and walk in g.graph_walks]
        general = [g for g in self.groups if node in g.node_names and not g.graph_walks]
        chosen = specific or general
        if not chosen:
            raise ValueError(f"node_groups: node {node!r} (used by walk {walk!r}) is placed on no rank")
        if len(chosen) > 1:
            raise ValueError(f"node_groups: node {node!r} is placed twice for walk {walk!r}")
        return chosen[0].ranks[0]

    def rank_of(self, walk: str, node: str) -> int:
        return self._owner[(walk, node)]

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self._owner.values()))

    def nodes_on(self, rank: int) -> set[str]:
        return {node for (_, node), r in self._owner.items() if r == rank}


def single_rank(graph: Graph) -> Placement:
    """Every node on rank 0: the default single-device deployment."""
    return Placement(graph, (NodeGroup(tuple(graph.nodes), (0,)),))


@dataclass(frozen=True)
class Routes:
    """For one walk: which ranks read each variable, and which rank runs each step."""

    readers: dict[str, frozenset[int]]
    step_rank: dict[int, int]  # id(step) -> rank

    @classmethod
    def of(cls, walk: Walk, placement: Placement) -> "Routes":
        readers: dict[str, set[int]] = {}
        step_rank: dict[int, int] = {}
        for step in walk.steps():
            rank = placement.rank_of(walk.name, step.node)
            step_rank[id(step)] = rank
            for var in step.read_vars:
                readers.setdefault(var, set()).add(rank)
        for edge in walk.streams:  # a stream's consumer reads every item of its source
            readers.setdefault(edge.source, set()).add(step_rank[id(edge.into)])
        return cls({v: frozenset(r) for v, r in readers.items()}, step_rank)

    def rank(self, step: Step) -> int:
        return self.step_rank[id(step)]

    def destinations(self, var: str, exclude: int | None = None) -> list[int]:
        return sorted(r for r in self.readers.get(var, ()) if r != exclude)


def all_routes(graph: Graph, placement: Placement) -> dict[str, Routes]:
    return {name: Routes.of(walk, placement) for name, walk in graph.walks.items()}


def build_placement(graph: Graph, config) -> Placement:
    """The placement a deployment config asks for; every node on rank 0 when it names none."""
    if not config.node_groups:
        return single_rank(graph)
    groups = []
    for i, g in enumerate(config.node_groups):
        for name in g.node_names:
            if name not in graph.nodes:
                raise ValueError(f"node_groups[{i}].node_names: unknown node {name!r}; nodes are {sorted(graph.nodes)}")
        for walk in g.graph_walks:
            if walk not in graph.walks:
                raise ValueError(f"node_groups[{i}].graph_walks: unknown walk {walk!r}; walks are {sorted(graph.walks)}")
        if len(g.ranks) != g.tp_size:
            raise ValueError(f"node_groups[{i}].ranks: {len(g.ranks)} ranks given for tp_size {g.tp_size}")
        if g.tp_size > 1:
            raise ValueError(f"node_groups[{i}].tp_size: tensor parallelism is not available yet")
        groups.append(NodeGroup(tuple(g.node_names), tuple(g.ranks), tuple(g.graph_walks), g.tp_size))
    return Placement(graph, tuple(groups))
