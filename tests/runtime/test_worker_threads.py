"""How many intra-op threads a worker process takes: the ranks of one model share the host's
cores; each worker of a many-model deployment (whose parts take turns) gets all of them."""

from __future__ import annotations

import os

from mstar.runtime.workers import worker_threads


def test_ranks_of_one_model_share_the_cores():
    cores = os.cpu_count() or 1
    assert worker_threads({"model": "smollm2"}, 1) == cores
    assert worker_threads({"model": "smollm2"}, 3) == max(1, cores // 3)
    assert worker_threads({"model": "smollm2"}, 10 * cores) == 1


def test_the_parts_of_a_many_model_deployment_take_turns():
    assert worker_threads({"model": "voice_agent"}, 3) == (os.cpu_count() or 1)


def test_local_replicas_split_the_cores():
    cores = os.cpu_count() or 1
    assert worker_threads({"model": "smollm2", "replicas": 2}, 1) == max(1, cores // 2)
    assert worker_threads({"model": "smollm2", "replicas": 2}, 2) == max(1, cores // 4)
    assert worker_threads({"model": "voice_agent", "replicas": 2}, 3) == max(1, cores // 2)
