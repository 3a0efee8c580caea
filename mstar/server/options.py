"""What ``mstar serve`` / ``mstar-serve`` hand to ``mstar.server.serve.serve``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

TensorCommProtocol = Literal["SHM", "TCP", "RDMA"]
TENSOR_COMM_PROTOCOLS: tuple[str, ...] = ("SHM", "TCP", "RDMA")
DEVICES: tuple[str, ...] = ("cpu", "cuda")
BACKENDS: tuple[str, ...] = ("local", "ray")
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class VideoJobOptions:
    """The job store's bounds: at most ``max_jobs`` jobs kept (running or finished), each
    finished one kept ``ttl_s`` seconds. A dataclass, so an unknown key is a TypeError."""

    max_jobs: int = 64
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_jobs < 1:
            raise ValueError(f"max_jobs must be 1 or more, got {self.max_jobs}")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be a positive number of seconds, got {self.ttl_s}")


@dataclass
class ServeOptions:
    """Everything needed to start a server; the runtime fills in what is left as None.

    ``model`` is a registry name (None: the one ``config`` names).
    ``config`` is a YAML deployment file whose settings the explicit options override.
    ``device`` None: the config file's, else cpu. ``gpus`` are device
    indices for the workers (None: all visible). ``in_process`` runs the model in the
    server process instead of separate workers (debugging, tests). ``timeout`` caps each
    request's seconds, queueing included (None: the config's ``request_timeout_s``).
    ``max_worker_restarts``: how many times each worker rank's process is restarted after
    it dies before the server shuts down (exit status 1). ``backend`` starts the workers as
    local processes or Ray actors (None: the config file's, else local). ``video_jobs``:
    the bounds of the /v1/videos job store.
    """

    model: str | None = None
    config: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: str | None = None
    gpus: list[int] | None = None
    cache_dir: str | None = None
    tensor_comm_protocol: TensorCommProtocol = "SHM"
    backend: str | None = None
    log_level: str = "info"
    log_stats: bool = False
    api_key: str | None = None
    in_process: bool = False
    served_model_names: list[str] = field(default_factory=list)
    timeout: float | None = None
    max_worker_restarts: int = 3
    video_jobs: VideoJobOptions = field(default_factory=VideoJobOptions)

    def __post_init__(self) -> None:
        if self.model is None and self.config is None:
            raise ValueError("a model or a config file is required")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.device is not None and self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.tensor_comm_protocol not in TENSOR_COMM_PROTOCOLS:
            raise ValueError(
                f"tensor_comm_protocol must be one of {', '.join(TENSOR_COMM_PROTOCOLS)}, "
                f"got {self.tensor_comm_protocol!r}"
            )
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout}")
        if self.max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts must be 0 or more, got {self.max_worker_restarts}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
