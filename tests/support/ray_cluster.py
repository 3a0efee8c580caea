"""A local multi-node Ray cluster for the ``backend: ray`` tests: a head node and one worker
node on this machine, CPU only, with the smallest object store Ray accepts (the models never
cross it); the worker node alone has the custom resource ``worker_resource``, so a rank that
asks for it is placed there."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray.cluster_utils import Cluster

OBJECT_STORE = 80 * 1024 * 1024


@contextmanager
def two_node_cluster(worker_cpus: int, worker_resource: str) -> Iterator[Cluster]:
    """The cluster, connected (``ray.init``); ``cluster.worker_node_id`` names the worker node."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": OBJECT_STORE})
    worker = cluster.add_node(num_cpus=worker_cpus, object_store_memory=OBJECT_STORE,
                              resources={worker_resource: worker_cpus})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    cluster.worker_node_id = worker.node_id
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
