"""Placement: which worker rank runs each node, optionally per walk, and where tensors go.

Built from the deployment YAML's ``node_groups``; the routing table derived from it is
static per (walk, step), so the conductor computes it once at load time. A group split over
several ranks (``tp_size`` x ``sp_size``) is led by its first rank: plans go there and the
group's other ranks follow it in lockstep (``mstar.runtime.lockstep``).
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
    sp_size: int = 1

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def is_split(self) -> bool:
        return len(self.ranks) > 1

    @property
    def layout(self) -> tuple[tuple[int, ...], int, int]:
        """How its nodes are split: (ranks, tp_size, sp_size); groups of one layout share engines."""
        return self.ranks, self.tp_size, self.sp_size


@dataclass
class Placement:
    """Maps (walk, node) to the rank whose worker owns it."""

    graph: Graph
    groups: tuple[NodeGroup, ...]
    _group: dict[tuple[str, str], NodeGroup] = field(default_factory=dict, init=False)
    _owner: dict[tuple[str, str], int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        for walk in self.graph.walks.values():
            for node in sorted({step.node for step in walk.steps()}):
                group = self._group[(walk.name, node)] = self._find(walk.name, node)
                self._owner[(walk.name, node)] = group.leader

    def _find(self, walk: str, node: str) -> NodeGroup:
        specific = [i for i, g in enumerate(self.groups) if node in g.node_names and walk in g.graph_walks]
        general = [i for i, g in enumerate(self.groups) if node in g.node_names and not g.graph_walks]
        chosen = specific or general
        if not chosen:
            raise ValueError(f"node_groups: node {node!r} (used by walk {walk!r}) is placed on no rank")
        if len(chosen) > 1:
            raise ValueError(f"node_groups[{chosen[1]}].node_names: node {node!r} is placed twice for walk "
                             f"{walk!r} (also by node_groups[{chosen[0]}])")
        return self.groups[chosen[0]]

    def rank_of(self, walk: str, node: str) -> int:
        """The rank plans for ``node`` go to in ``walk`` (its group's leader)."""
        return self._owner[(walk, node)]

    def group_of(self, walk: str, node: str) -> NodeGroup:
        """The node group running ``node`` in ``walk`` (all its ranks, tp and sp sizes)."""
        return self._group[(walk, node)]

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self._owner.values()))

    def nodes_on(self, rank: int) -> set[str]:
        """The nodes whose plans go to ``rank`` (it leads their group)."""
        return {node for (_, node), r in self._owner.items() if r == rank}

    def groups_on(self, rank: int) -> dict[NodeGroup, set[str]]:
        """Every group ``rank`` is a member of, leader or not, with the nodes it runs for some
        walk: a worker builds each group's engines under that group's parallel state."""
        found: dict[NodeGroup, set[str]] = {}
        for (_, node), group in self._group.items():
            if rank in group.ranks:
                found.setdefault(group, set()).add(node)
        return found

    def split_groups(self) -> list[NodeGroup]:
        """The groups run over several ranks (``tp_size x sp_size > 1``) in config order:
        every worker process creates their process groups in this order
        (``mstar.distributed.build_mesh`` is collective over the whole world)."""
        return [g for g in self.groups if g.is_split]

    def followers(self) -> set[int]:
        """The ranks that follow the leader of a split group (they get no plans)."""
        return {r for g in self.split_groups() for r in g.ranks[1:]}


def single_rank(graph: Graph) -> Placement:
    """Every node on rank 0: the default single-device deployment."""
    return Placement(graph, (NodeGroup(tuple(graph.nodes), (0,)),))


@dataclass(frozen=True)
class Routes:
    """For one walk: which ranks read each variable, and which rank runs each step."""

    readers: dict[str, frozenset[int]]
    step_rank: dict[int, int]  # id(step) -> rank

    @classmethod
    def of(cls, walk: Walk, placement: Placement) -> Routes:
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


def build_placement(graph: Graph, config, spec=None) -> Placement:
    """The placement a deployment config asks for; every node on rank 0 when it names none.

    ``spec`` (the model's ``ModelSpec``) lets a split group (``tp_size`` or ``sp_size`` > 1)
    be checked against the sizes its nodes can be split by (``ModelSpec.parallel_dims``).
    Errors are ``ValueError``s naming the config key.
    """
    if not config.node_groups:
        return single_rank(graph)
    groups = []
    for i, g in enumerate(config.node_groups):
        for name in g.node_names:
            if name not in graph.nodes:
                raise ValueError(f"node_groups[{i}].node_names: unknown node {name!r}; nodes are {sorted(graph.nodes)}")
            if g.node_names.count(name) > 1:
                raise ValueError(f"node_groups[{i}].node_names: node {name!r} is listed twice")
        for walk in g.graph_walks:
            if walk not in graph.walks:
                raise ValueError(f"node_groups[{i}].graph_walks: unknown walk {walk!r}; "
                                 f"walks are {sorted(graph.walks)}")
        if len(g.ranks) != g.tp_size * g.sp_size:  # also checked when the config is parsed
            raise ValueError(f"node_groups[{i}].tp_size: tp_size ({g.tp_size}) x sp_size ({g.sp_size}) "
                             f"needs {g.tp_size * g.sp_size} ranks, node_groups[{i}].ranks lists {len(g.ranks)}")
        groups.append(NodeGroup(tuple(g.node_names), tuple(g.ranks), tuple(g.graph_walks), g.tp_size, g.sp_size))
    _check_devices(config)
    placement = Placement(graph, tuple(groups))
    split = [(i, g) for i, g in enumerate(groups) if g.tp_size * g.sp_size > 1]
    if split and spec is not None:
        _check_divisible(split, spec.parallel_dims())
    _check_followers(groups)
    return placement


def _check_followers(groups: list[NodeGroup]) -> None:
    """A follower of a split group runs only in lockstep with its leader: it may belong to
    no other group but split groups of the same leader. A node runs under one layout per
    rank (its engine on that rank is built once)."""
    leader_of: dict[int, tuple[int, int]] = {}  # follower rank -> (its leader, the group's index)
    for i, g in enumerate(groups):
        for r in g.ranks[1:] if g.is_split else ():
            leader_of.setdefault(r, (g.leader, i))
    for j, g in enumerate(groups):
        for r in g.ranks:
            if r not in leader_of:
                continue
            leader, i = leader_of[r]
            if not g.is_split or g.leader != leader:
                raise ValueError(f"node_groups[{j}].ranks: rank {r} follows rank {leader} in the split group "
                                 f"node_groups[{i}], so it cannot run other nodes (only split groups led by "
                                 f"rank {leader})")
    layout_of: dict[tuple[int, str], int] = {}  # (rank, node) -> index of the group that set its layout
    for j, g in enumerate(groups):
        for r in g.ranks:
            for node in g.node_names:
                i = layout_of.setdefault((r, node), j)
                if groups[i].layout != g.layout and (groups[i].is_split or g.is_split):
                    raise ValueError(f"node_groups[{j}].ranks: node {node!r} already runs on rank {r} split "
                                     f"differently (node_groups[{i}]); a node has one layout per rank")


def _check_divisible(split: list[tuple[int, NodeGroup]], dims: dict) -> None:
    for i, g in split:
        key = "tp_size" if g.tp_size > 1 else "sp_size"
        for node in g.node_names:
            if node not in dims:
                raise ValueError(f"node_groups[{i}].{key}: node {node!r} cannot be split over ranks "
                                 f"(tp_size and sp_size must be 1)")
            problems = dims[node].problems(g.tp_size, g.sp_size)
            if problems:
                raise ValueError(f"node_groups[{i}].{key}: node {node!r}: " + "; ".join(problems))


def _check_devices(config) -> None:
    """Every rank needs a device: with ``device: cuda`` and no ``gpus`` list, rank r runs on
    ``cuda:r``, which must exist (a ``gpus`` list is checked when the config is parsed).
    Under ``backend: ray`` the ranks' GPUs are the cluster's: Ray's placement checks them."""
    if config.device != "cuda" or config.gpus is not None or config.backend == "ray":
        return
    import torch

    count = torch.cuda.device_count()
    for i, g in enumerate(config.node_groups):
        missing = [r for r in g.ranks if r >= count]
        if missing:
            raise ValueError(f"node_groups[{i}].ranks: rank {missing[0]} does not exist: "
                             f"this machine has {count} CUDA device(s)")
