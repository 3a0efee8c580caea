"""``mstar serve``: the checks, the deployment started, the HTTP app over it, uvicorn until
stopped.

What can stop the server from starting is found before anything heavy loads and raised as
a ``ConfigError`` (the CLI prints its one line and exits with status 2): the config file and
options first, then the port (its socket is bound before the model loads and handed to
uvicorn, so a port in use is found at once and nothing takes it meanwhile), then, in
``start``, the model, its knobs, the device and the weights, before any worker starts.

SIGTERM stops the server as Ctrl-C does: uvicorn finishes the requests under way (up to
``SHUTDOWN_GRACE_S``), the workers are stopped, and ``serve`` returns 0.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import sys
from typing import Any

from mstar.config import ConfigError, DeploymentConfig, load_config, parse_config
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
            raise ConfigError("--tensor-comm-protocol: RDMA is not available in this build; use SHM (one host) "
                              "or TCP")
        overrides["tensor_comm_protocol"] = options.tensor_comm_protocol
    if options.backend:
        overrides["backend"] = options.backend
    if options.config:
        if options.model:
            overrides["model"] = options.model
        return load_config(options.config, overrides)
    return parse_config({"model": options.model, **overrides}, f"model {options.model}")


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (as uvicorn binds it) but not listening yet."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port: port {port} on {host} is in use by another process; stop it, or serve "
                              "on another port with --port") from None
        raise ConfigError(f"--host/--port: cannot listen on {host}:{port} ({err.strerror or err}); pick another "
                          "address with --host or port with --port") from None
    sock.set_inheritable(True)
    return sock


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
    Returns the process exit status: 0 when stopped (SIGTERM or Ctrl-C included), 1 when
    the workers could not be kept alive (see ``start``) and the server shut itself down."""
    config = config_from_options(options)
    sock = listening_socket(options.host, options.port)
    # uvicorn catches SIGINT and SIGTERM while it runs and raises them again once it has
    # shut down; either one then usually ends ``serve`` as a KeyboardInterrupt (so does one
    # that comes while the model loads). A SIGINT raised again while asyncio's runner is
    # finishing can be taken by the runner instead: uvicorn then just returns (``_serve``).
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _serve(options, config, sock)
    except KeyboardInterrupt:
        log.info("stopped")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()


# The API server's threads (the event loop, the conductor, the emit thread) share one GIL. At
# Python's default of 5 ms a thread that wakes (the conductor, a step's result in) can wait that
# long behind one busy with SSE writes, while a decode step takes about as long: hand over sooner.
SWITCH_INTERVAL_S = 0.001


def _serve(options: ServeOptions, config: DeploymentConfig, sock: socket.socket) -> int:
    from mstar.runtime.launch import start
    from mstar.runtime.workers import freeze_startup_objects

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    stop = _StopServer()
    deployment = start(config, in_process=options.in_process, log_stats=options.log_stats,
                       max_worker_restarts=options.max_worker_restarts, on_give_up=stop)
    try:
        import uvicorn  # the HTTP side is imported once the model is up: a startup error comes sooner

        from mstar.server.app import create_app

        app = create_app(deployment.backend, served_model_names=options.served_model_names or None,
                         api_key=options.api_key, on_shutdown=deployment.close,
                         video_jobs=options.video_jobs)
        freeze_startup_objects()
        log.info("serving %s on http://%s:%d (Ctrl-C to stop)", config.model, options.host, options.port)
        stop.server = uvicorn.Server(uvicorn.Config(app, log_level=options.log_level,
                                                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
        if stop.reason is not None:  # it gave up while the app was being built
            stop.server.should_exit = True
        stop.server.run(sockets=[sock])
    finally:
        deployment.close()
    if stop.reason is not None:
        log.critical("the server shut down: %s", stop.reason)
        return 1
    log.info("stopped")
    return 0
