"""Worker ranks as Ray actors: a deployment over the nodes of a Ray cluster (``backend: ray``).

Ray only starts, places and watches the workers. Each rank is an actor that runs the same
worker loop a local worker process runs (``run_worker``), driven by the same ZeroMQ plans
and results from the conductor, which stays in the ``mstar serve`` process with the API
server. What differs from the local launcher is where things are:

* every rank has a placement-group bundle (its CPUs, its GPU, the ``ray_resources`` of its
  node groups); the ranks of a split node group (tp/sp) share one ``STRICT_PACK`` group so
  they land on one node, other ranks get a group each, placed wherever Ray finds room; the
  split groups meet at a TCP rendezvous on the node of their first rank;
* the control sockets listen on the server's node IP, and each worker binds its tensor
  transport on its own node's IP (the address comes back in its ``WorkerReady`` and
  reaches every peer through the peer table);
* shared memory only works within a node: when the ranks span several nodes, ``SHM``
  becomes ``SHM+TCP`` (``transport/nodes.py``: shared memory between the ranks of a node,
  TCP between nodes, chosen per pair from the node names in the addresses). ``TCP`` stays
  TCP everywhere.

Ray is imported here only, and this module only when ``backend: ray`` is asked for.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mstar.config import ConfigError, DeploymentConfig
from mstar.runtime.heartbeat import HEARTBEAT_S, LOST_AFTER_S
from mstar.runtime.placement import Placement
from mstar.runtime.workers import ProcessWorkers, _Process

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # how long the cluster may take to find room for every bundle
ALIVE_CHECK_S = 0.25  # how often an actor's liveness is asked of Ray (each poll would be wasteful)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("backend: ray needs Ray, which is not installed here: pip install 'mstar[ray]'") from None
    return ray


@dataclass
class RayLayout:
    """Where the ranks will run: the placement groups reserved for them, the node of each
    rank's bundle, and the server's own node."""

    groups: list[Any]  # the placement groups (removed on close)
    bundle_of: dict[int, tuple[Any, int, dict[str, float]]]  # rank -> (group, bundle index, its resources)
    server_node: str
    server_ip: str
    protocol: str  # the tensor protocol every rank uses (SHM, TCP or SHM+TCP)

    def node_of(self, rank: int) -> str:
        """The node id the rank's bundle sits on now (Ray moves a bundle whose node died)."""
        ray = import_ray()
        group, index, _ = self.bundle_of[rank]
        return ray.util.placement_group_table(group)["bundles_to_node_id"][index]


def rank_bundles(config: DeploymentConfig, num_ranks: int) -> dict[int, dict[str, float]]:
    """Each rank's bundle: one CPU (and one GPU on CUDA), replaced or joined by the
    ``ray_resources`` of the node groups it belongs to (the largest amount where two of its
    groups name one resource)."""
    extra: dict[int, dict[str, float]] = {rank: {} for rank in range(num_ranks)}
    for group in config.node_groups:
        for rank in group.ranks:
            for name, amount in group.ray_resources.items():
                extra[rank][name] = max(amount, extra[rank].get(name, amount))
    default = {"CPU": 1.0, **({"GPU": 1.0} if config.device == "cuda" else {})}
    return {rank: default | extra[rank] for rank in range(num_ranks)}


def pack_strategy(config: DeploymentConfig, ranks: list[int]) -> str:
    """The Ray placement strategy of the bundles of ``ranks`` (one pack): the
    ``ray_placement`` of the split groups in it (two that disagree are a ``ConfigError``),
    else ``STRICT_PACK`` for several ranks and ``PACK`` for one."""
    chosen = {g.ray_placement for g in config.node_groups
              if g.ray_placement is not None and set(g.ranks) <= set(ranks)}
    if len(chosen) > 1:
        raise ConfigError(f"node_groups: the split groups over ranks {ranks} share ranks but ask for "
                          f"different ray_placement values {sorted(chosen)}")
    if chosen:
        return chosen.pop().upper()
    return "STRICT_PACK" if len(ranks) > 1 else "PACK"


def packs(placement: Placement, num_ranks: int) -> list[list[int]]:
    """The ranks that must share a node: those of each split group (merged where two split
    groups share a rank); every other rank alone."""
    pack_of = {rank: {rank} for rank in range(num_ranks)}
    for group in placement.split_groups():
        merged = set().union(*(pack_of[r] for r in group.ranks))
        for r in merged:
            pack_of[r] = merged
    seen: list[list[int]] = []
    for rank in range(num_ranks):
        ranks = sorted(pack_of[rank])
        if ranks not in seen:
            seen.append(ranks)
    return seen


def reserve(config: DeploymentConfig, placement: Placement, num_ranks: int, replica: int = 0) -> RayLayout:
    """Join (or start) the Ray cluster and reserve a bundle for every rank (of data-parallel
    replica ``replica``); a bundle that finds no room within ``PLACEMENT_TIMEOUT_S`` is a
    ``ConfigError`` naming its group's resources."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    if not ray.is_initialized():
        # address None: RAY_ADDRESS, else a cluster started with `ray start` on this host, else a new one
        ray.init(address=config.ray_address, log_to_driver=True)
    bundles = rank_bundles(config, num_ranks)
    groups, bundle_of = [], {}
    try:
        for ranks in packs(placement, num_ranks):
            strategy = pack_strategy(config, ranks)
            group = placement_group([bundles[r] for r in ranks], strategy=strategy,
                                    name=f"mstar-replica{replica}-ranks-{ranks[0]}")
            groups.append(group)
            for index, rank in enumerate(ranks):
                bundle_of[rank] = (group, index, bundles[rank])
        for group, ranks in zip(groups, packs(placement, num_ranks), strict=True):
            if not group.wait(PLACEMENT_TIMEOUT_S):
                wanted = [bundles[r] for r in ranks]
                raise ConfigError(
                    f"node_groups: the Ray cluster has no room for rank(s) {ranks} ({wanted}) within "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s; its resources are {ray.cluster_resources()}; check the "
                    f"groups' ray_resources and the nodes' --num-cpus/--num-gpus/--resources")
    except BaseException:
        for group in groups:
            remove_placement_group(group)
        raise
    server_node = ray.get_runtime_context().get_node_id()
    layout = RayLayout(groups, bundle_of, server_node, ray.util.get_node_ip_address(), config.tensor_comm_protocol)
    nodes = {rank: layout.node_of(rank) for rank in range(num_ranks)}
    if any(node != server_node for node in nodes.values()) and layout.protocol == "SHM":
        log.info("the ranks span several Ray nodes: shared memory within a node, TCP between nodes")
        layout.protocol = "SHM+TCP"
    for rank, node in sorted(nodes.items()):
        log.info("rank %d: a Ray bundle %s on node %s", rank, bundle_of[rank][2], node[:12])
    return layout


def release(layout: RayLayout) -> None:
    from ray.util.placement_group import remove_placement_group

    for group in layout.groups:
        try:
            remove_placement_group(group)
        except Exception as err:  # the cluster may be gone already
            log.info("could not remove a placement group: %s", err)


def _free_port() -> int:
    """A TCP port free now on the node this runs on (the split groups' rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def node_ip(ray, node: str) -> str:
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return ips.get(node, "address unknown")


class RankActor:
    """The Ray actor of one rank (decorated with ``ray.remote`` when first used)."""

    def serve(self, config_data: dict[str, Any], rank: int, frontend_rank: int, protocol_name: str,
              plan_addr: str, result_addr: str, rendezvous: str | None, threads: int) -> None:
        import ray
        import torch

        from mstar.runtime.workers import run_worker

        logging.basicConfig(level=os.environ.get("MSTAR_LOG_LEVEL", "INFO"),
                            format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
        torch.set_num_threads(max(1, threads))
        if config_data.get("device") == "cuda":  # Ray shows an actor only its own GPU: cuda:0
            config_data = {**config_data, "gpus": [0] * frontend_rank}
        # The actor's process is a child of its node's raylet; orphaned, its node is gone for Ray
        # (it would take Ray ~16 s to say so): it stops its heartbeats, and exits once idle.
        raylet = int(os.environ.get("RAY_RAYLET_PID", os.getppid()))
        run_worker(config_data, rank, frontend_rank, protocol_name, plan_addr, result_addr, rendezvous,
                   host=ray.util.get_node_ip_address(), node=ray.get_runtime_context().get_node_id(),
                   server_alive=lambda: os.getppid() == raylet, heartbeat_s=HEARTBEAT_S)


# How ``_ActorHandle.end`` begins when the actor's raylet is gone: the node is lost, not the rank.
UNREACHABLE = "ActorUnavailableError"


class _ActorHandle:
    """A rank's actor behind the calls ``ProcessWorkers`` makes of a process.

    ``launch()`` creates the actor and starts its worker loop (returning the actor and the
    loop's ``ObjectRef``). With ``held``, the launch waits while ``held()`` is true: a rank
    restarted after its node was lost waits for Ray to move its bundle off that node (an
    actor created in a bundle of a node Ray has not given up yet dies with the node)."""

    def __init__(self, ray, launch: Callable[[], tuple[Any, Any]], rank: int, node: str,
                 held: Callable[[], bool] | None = None):
        self.ray, self.rank, self.node = ray, rank, node
        self.name = f"mstar-worker-{rank}"
        self.pid = None
        self.actor = self.done = None
        self._launch, self._held = launch, held
        self._alive, self._checked = True, 0.0
        if held is None or not held():
            self._start()
        else:
            log.warning("rank %d: waiting for Ray to move its bundle off the lost node %s", rank, node[:8])

    def _start(self) -> None:
        self.actor, self.done = self._launch()
        self._held = None

    def start_if_free(self) -> None:
        """Launch a held actor once ``held()`` turns false (asked every ``ALIVE_CHECK_S``)."""
        if self._held is not None and self._alive and time.monotonic() - self._checked > ALIVE_CHECK_S:
            self._checked = time.monotonic()
            if not self._held():
                self._start()

    def is_alive(self) -> bool:
        if self._alive and self.done is not None and time.monotonic() - self._checked > ALIVE_CHECK_S:
            self._checked = time.monotonic()
            finished, _ = self.ray.wait([self.done], timeout=0)
            self._alive = not finished
        return self._alive

    def join(self, timeout: float | None = None) -> None:
        if self._alive and self.done is not None:
            finished, _ = self.ray.wait([self.done], timeout=timeout)
            self._alive = not finished

    def kill(self) -> None:
        if self.actor is not None:
            self.ray.kill(self.actor, no_restart=True)
        self._alive = False

    def end(self) -> str:
        """How the actor's worker loop ended (the first line of Ray's error)."""
        if self.done is None:
            return "it was never started (its bundle stayed on a lost node)"
        try:
            self.ray.get(self.done, timeout=0)
        except Exception as err:
            return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        return "returned"


class RayWorkers(ProcessWorkers):
    """``ProcessWorkers`` whose ranks are Ray actors pinned to their ``RayLayout`` bundles.
    A restarted rank gets a new actor in the same bundle (on another node when Ray moved
    the bundle off a dead one). Ranks send heartbeats: one silent for ``LOST_AFTER_S`` is
    lost with its node, long before Ray declares the node dead."""

    lost_after_s = LOST_AFTER_S
    lost_nodes: set[str]  # the nodes of ranks declared lost: a rank there waits for its bundle to move

    def __init__(self, config_data: dict[str, Any], num_ranks: int, layout: RayLayout, frontend_transport,
                 **kwargs):
        self.ray = import_ray()
        self.layout = layout
        self.lost_nodes = set()
        self.control_host = layout.server_ip
        self._actor_class = self.ray.remote(RankActor)
        try:
            super().__init__(config_data, num_ranks, layout.protocol, frontend_transport, **kwargs)
        except BaseException:
            release(layout)
            raise

    def _start(self, rank: int, plan_addr: str, result_addr: str, rendezvous: str | None) -> _ActorHandle:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, index, bundle = self.layout.bundle_of[rank]

        def launch():
            actor = self._actor_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0, max_concurrency=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=index),
            ).remote()
            return actor, actor.serve.remote(self.config_data, rank, self.num_ranks, self.protocol_name,
                                             plan_addr, result_addr, rendezvous, int(bundle["CPU"]))

        node = self.layout.node_of(rank)
        held = (lambda: not self._bundle_moved(rank)) if node in self.lost_nodes else None
        return _ActorHandle(self.ray, launch, rank, node, held)

    def _bundle_moved(self, rank: int) -> bool:
        """Whether Ray has placed the rank's bundle again, on a node not lost."""
        group, index, _ = self.layout.bundle_of[rank]
        table = self.ray.util.placement_group_table(group)
        try:
            node = table["bundles_to_node_id"][index]
        except (KeyError, IndexError):
            return False
        return table["state"] == "CREATED" and bool(node) and node not in self.lost_nodes

    def _rendezvous(self) -> str | None:
        """The split groups' ``torch.distributed`` rendezvous: a TCP store on the node of
        their first rank, at a port found free there (a new one per restart of the world)."""
        if not self.world:
            return None
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = self.layout.node_of(min(self.world))
        find = self.ray.remote(num_cpus=0)(_free_port)
        port = self.ray.get(find.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote())
        return f"tcp://{node_ip(self.ray, node)}:{port}"

    def _receive(self, timeout: float):
        for process in self.ranks.values():
            if not process.failed:
                process.proc.start_if_free()
        return super()._receive(timeout)

    def _ready(self, rank: int, msg) -> None:
        """Where the rank runs is settled once it is up: a restart's actor was created while
        its bundle may still have named a lost node, and Ray moved the bundle since."""
        self.ranks[rank].proc.node = self.layout.node_of(rank)
        super()._ready(rank, msg)

    def _where(self, handle: _ActorHandle) -> str:
        return f"Ray actor on node {handle.node[:8]} ({node_ip(self.ray, handle.node)})"

    def _gone(self, process: _Process) -> str:
        handle = process.proc
        how = handle.end()
        if how.startswith(UNREACHABLE):  # its raylet went before the heartbeats ran out
            return self._node_lost(handle, f"Ray cannot reach its actor ({how})")
        return f"worker rank {handle.rank} ({self._where(handle)}) died: {how}"

    def _lost(self, process: _Process, silence: float) -> str:
        return self._node_lost(process.proc, f"no heartbeat for {silence:.1f} s")

    def _node_lost(self, handle: _ActorHandle, sign: str) -> str:
        """The rank's node is taken as lost: its restart waits for Ray to move the bundle."""
        self.lost_nodes.add(handle.node)
        return (f"worker rank {handle.rank} ({self._where(handle)}) was lost: {sign} "
                f"(its node or its raylet is down, or unreachable)")

    def _late(self, process: _Process) -> str:
        return f"worker rank {process.proc.rank} ({self._where(process.proc)}) did not load"

    def close(self) -> None:
        closed = self._closed
        super().close()
        if not closed:
            release(self.layout)
