"""A local multi-node Ray cluster for the ``backend: ray`` tests: a head node and worker nodes
on this machine, CPU only, with the smallest object store Ray accepts (the models never
cross it); the worker nodes alone have the custom resource ``worker_resource``, so a rank
that asks for it is placed on one of them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray.cluster_utils import Cluster

OBJECT_STORE = 80 * 1024 * 1024


def add_worker_node(cluster: Cluster, cpus: int, resource: str):
    """Another worker node with ``cpus`` CPUs and as many units of ``resource``; its Ray node."""
    node = cluster.add_node(num_cpus=cpus, object_store_memory=OBJECT_STORE, resources={resource: cpus})
    cluster.wait_for_nodes()
    return node


@contextmanager
def two_node_cluster(worker_cpus: int, worker_resource: str, worker_nodes: int = 1) -> Iterator[Cluster]:
    """The cluster, connected (``ray.init``); ``cluster.worker_node_id`` names the (first)
    worker node, ``cluster.workers`` holds the worker nodes' Ray nodes (``node_id``, their
    processes), ``worker_nodes`` of them."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": OBJECT_STORE})
    cluster.workers = [add_worker_node(cluster, worker_cpus, worker_resource) for _ in range(worker_nodes)]
    ray.init(address=cluster.address)
    cluster.worker_node_id = cluster.workers[0].node_id
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
