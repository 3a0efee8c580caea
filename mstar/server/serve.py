"""``mstar serve``: the deployment started, the HTTP app over it, uvicorn until stopped."""

from __future__ import annotations

import logging
from typing import Any

from mstar.config import ConfigError, DeploymentConfig
from mstar.runtime.launch import config_for, start
from mstar.server.options import ServeOptions

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 10  # how long a stopping server waits for responses still under way


def config_from_options(options: ServeOptions) -> DeploymentConfig:
    """The deployment config ``mstar serve`` runs: the file or model defaults, then the
    explicit command-line options (a ``ServeOptions``) on top."""
    overrides: dict[str, Any] = {}
    if options.device:
        overrides["device"] = options.device
    if options.gpus:
        overrides["gpus"] = list(options.gpus)
    if options.cache_dir:
        overrides["cache_dir"] = options.cache_dir
    if options.timeout is not None:
        overrides["request_timeout_s"] = options.timeout
    if options.tensor_comm_protocol:
        if options.tensor_comm_protocol == "RDMA":
            raise ConfigError("--tensor-comm-protocol: RDMA is not available in this build; use SHM or TCP")
        overrides["tensor_comm_protocol"] = options.tensor_comm_protocol
    return config_for(options.model, options.config, overrides)


class _StopServer:
    """``on_give_up`` for ``serve``: remember why and make uvicorn shut down."""

    def __init__(self) -> None:
        self.server = None
        self.reason: str | None = None

    def __call__(self, reason: str) -> None:
        self.reason = reason
        if self.server is not None:
            self.server.should_exit = True


def serve(options: ServeOptions) -> int:
    """Entry point behind ``mstar serve``: start everything and run uvicorn until stopped.
    Returns the process exit status: 0 when stopped, 1 when the workers could not be kept
    alive (see ``start``) and the server shut itself down."""
    import uvicorn

    from mstar.server.app import create_app

    config = config_from_options(options)
    stop = _StopServer()
    deployment = start(config, in_process=options.in_process, log_stats=options.log_stats,
                       max_worker_restarts=options.max_worker_restarts, on_give_up=stop)
    app = create_app(deployment.backend, served_model_names=options.served_model_names or None,
                     api_key=options.api_key, on_shutdown=deployment.close)
    log.info("serving %s on http://%s:%d", config.model, options.host, options.port)
    stop.server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port,
                                                log_level=options.log_level,
                                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    if stop.reason is not None:  # it gave up while the app was being built
        stop.server.should_exit = True
    try:
        stop.server.run()
    finally:
        deployment.close()
    if stop.reason is not None:
        log.critical("the server shut down: %s", stop.reason)
        return 1
    return 0
