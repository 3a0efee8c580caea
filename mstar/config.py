"""The deployment config: one typed object, validated at startup, errors naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A deployment config that cannot start; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeGroupConfig(_Strict):
    node_names: list[str] = Field(min_length=1)
    ranks: list[int] = Field(min_length=1)
    graph_walks: list[str] = Field(default_factory=list)
    tp_size: int = Field(1, ge=1)  # tensor parallel: heads and weights split over ranks
    sp_size: int = Field(1, ge=1)  # Ulysses sequence parallel (DiT attention); ranks = tp x sp
    # backend: ray only: resources each rank's placement-group bundle asks for beside its CPU (and
    # GPU), e.g. a custom resource that only some Ray nodes have, to choose where the group runs.
    ray_resources: dict[str, float] = Field(default_factory=dict)
    # backend: ray only, a split group (tp/sp) only: how Ray places its ranks' bundles. None:
    # strict_pack (one node). strict_spread puts every rank on a node of its own (a group
    # across machines: gloo, or NCCL over the network); pack/spread are Ray's soft versions.
    ray_placement: Literal["strict_pack", "pack", "spread", "strict_spread"] | None = None


class KVCacheConfig(_Strict):
    max_num_pages: int = Field(1024, ge=1)
    page_size: int = Field(16, ge=1)


class StatePoolConfig(_Strict):
    """A recurrent-state pool (gated DeltaNet, Mamba): slots per request, sink included."""

    max_slots: int = Field(ge=2)
    state_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class ResourcesConfig(_Strict):
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    gdn_state: StatePoolConfig | None = None  # None: max_concurrent_requests + 1 slots
    transducer_state: StatePoolConfig | None = None  # a transducer's decoder states; None: as gdn_state
    mamba_state: StatePoolConfig | None = None  # Mamba-2 conv windows + SSM states; None: as gdn_state
    encoder_state: StatePoolConfig | None = None  # a streamed encoder's per-call state; None: as gdn_state
    codec_state: StatePoolConfig | None = None  # a streamed codec decoder's per-call state; None: as gdn_state
    talker_kv: KVCacheConfig | None = None  # a talker's own paged KV (nemotron_duplex); None: sized for the cap


class StreamPacingConfig(_Strict):
    """Streaming-aware scheduling of the requests whose walk streams media to the client
    (``mstar.runtime.pacing``)."""

    ahead_s: float = Field(2.0, gt=0)  # media buffered at the client past which a stream sits out steps
    max_streams: int | None = Field(None, ge=1)  # streaming requests stepped per tick at most (None: all)


class PartConfig(_Strict):
    """One model of a many-model deployment (``models.<part>``): the keys it sets replace the
    part's defaults; what it leaves out comes from the deployment (device, dtype,
    load_format, max_seq_len, max_concurrent_requests) or the part's own defaults."""

    model: str | None = None  # registry key; None: the part's default model
    model_path: str | None = None
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    max_seq_len: int | None = Field(None, ge=2)
    resources: ResourcesConfig | None = None
    model_kwargs: dict[str, Any] = Field(default_factory=dict)


class DeploymentConfig(_Strict):
    model: str
    model_path: str | None = None  # HF id or local directory; None: the registry default
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    gpus: list[int] | None = None  # CUDA device index of each rank (default: rank r -> cuda:r)
    max_seq_len: int = Field(2048, ge=2)
    max_concurrent_requests: int = Field(16, ge=1)
    # Requests allowed to wait for admission beyond the running ones; past it the API
    # answers 429. None: 4 x max_concurrent_requests.
    max_queue_size: int | None = Field(None, ge=0)
    node_groups: list[NodeGroupConfig] = Field(default_factory=list)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    model_kwargs: dict[str, Any] = Field(default_factory=dict)  # typed by the family: ModelSpec.Knobs
    cache_dir: str | None = None
    tensor_comm_protocol: Literal["INPROC", "SHM", "TCP"] = "SHM"
    # Who starts the worker ranks: "local" (a process each on this host) or "ray" (an actor each
    # on a Ray cluster, see docs/multinode.md). ray_address: the cluster to join (None: the
    # RAY_ADDRESS environment variable, else a Ray instance started on this host).
    backend: Literal["local", "ray"] = "local"
    # Data-parallel copies of the whole placement (each its own ranks, pages and slots); each new
    # request goes to the replica with the fewest open requests. With device: cuda, replica i
    # takes the next num_ranks GPUs (gpus, when given, lists them all).
    replicas: int = Field(1, ge=1)
    ray_address: str | None = None
    request_timeout_s: float | None = Field(None, gt=0)
    # Threads that prepare requests (templates, tokenising, decoding uploaded media) before they
    # reach the runtime. None: asyncio's default executor, min(32, cores + 4) threads. Preparing
    # holds the GIL part of the time, so more threads can be slower: Pi0.5's camera images
    # prepared fastest on 4 threads of a 16-core host (docs/benchmarks.md, S10).
    prepare_threads: int | None = Field(None, ge=1)
    stream_pacing: StreamPacingConfig | None = None  # None: every ready step runs as soon as it can
    # Sessions (``mstar.runtime.sessions``): idle sessions kept per deployment (the least
    # recently used past it are evicted), the bytes their state may hold on one worker rank
    # (an int or "4GiB", "512MB"; None: no byte bound; past it the least recently used holding
    # bytes there are evicted, and a session over it by itself is not kept), and the cap on a
    # request's ``session_timeout_s``.
    session_store_size: int = Field(16, ge=1)
    session_store_bytes: ByteSize | None = Field(None, gt=0)
    session_timeout_max_s: float = Field(3600.0, gt=0)
    # The models of a many-model deployment (``voice_agent``), by part name; their nodes are
    # named ``<part>/<node>`` in node_groups. Only such a deployment takes it.
    models: dict[str, PartConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ranks_are_dense(self) -> DeploymentConfig:
        ranks = sorted({r for g in self.node_groups for r in g.ranks})
        if ranks and ranks != list(range(len(ranks))):
            raise ValueError(f"node_groups: ranks must be 0..N-1 with none skipped, got {ranks}")
        return self

    @model_validator(mode="after")
    def _ray_keys_need_ray(self) -> DeploymentConfig:
        for i, g in enumerate(self.node_groups):
            if g.ray_resources and self.backend != "ray":
                raise ValueError(f"node_groups[{i}].ray_resources: only backend: ray places ranks by Ray "
                                 f"resources; set backend: ray or remove the key")
            if g.ray_placement is not None and self.backend != "ray":
                raise ValueError(f"node_groups[{i}].ray_placement: only backend: ray places ranks by Ray; "
                                 f"set backend: ray or remove the key")
            if g.ray_placement is not None and g.tp_size * g.sp_size == 1:
                raise ValueError(f"node_groups[{i}].ray_placement: only a split group (tp_size or sp_size > 1) "
                                 f"has several ranks to place together")
            negative = sorted(k for k, v in g.ray_resources.items() if v < 0)
            if negative:
                raise ValueError(f"node_groups[{i}].ray_resources.{negative[0]}: must be 0 or more")
        return self

    @model_validator(mode="after")
    def _group_ranks_exist(self) -> DeploymentConfig:
        for i, g in enumerate(self.node_groups):
            twice = sorted({r for r in g.ranks if g.ranks.count(r) > 1})
            if twice:
                raise ValueError(f"node_groups[{i}].ranks: rank {twice[0]} is listed twice")
            if len(g.ranks) != g.tp_size * g.sp_size:
                raise ValueError(f"node_groups[{i}].tp_size: tp_size ({g.tp_size}) x sp_size ({g.sp_size}) "
                                 f"needs {g.tp_size * g.sp_size} ranks, node_groups[{i}].ranks lists {len(g.ranks)}")
            if self.device == "cuda" and self.gpus is not None:
                missing = [r for r in g.ranks if r >= len(self.gpus)]
                if missing:
                    raise ValueError(f"node_groups[{i}].ranks: rank {missing[0]} does not exist: "
                                     f"gpus lists {len(self.gpus)} device(s)")
        return self

    def device_of(self, rank: int):
        import torch

        if self.device == "cpu":
            return torch.device("cpu")
        if self.gpus is not None:
            if rank >= len(self.gpus):
                raise ConfigError(f"gpus: {len(self.gpus)} GPUs given for {rank + 1}+ ranks")
            return torch.device("cuda", self.gpus[rank])
        return torch.device("cuda", rank)

    @property
    def queue_limit(self) -> int:
        """How many requests may wait for admission (``max_queue_size`` or its default)."""
        return self.max_queue_size if self.max_queue_size is not None else 4 * self.max_concurrent_requests

    @property
    def num_ranks(self) -> int:
        return 1 + max((r for g in self.node_groups for r in g.ranks), default=0)

    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        return getattr(torch, self.dtype)


def parse_config(data: dict[str, Any], source: str = "config") -> DeploymentConfig:
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"]) or "(top level)"
            if e["type"] == "extra_forbidden":
                problems.append(f"{key}: unknown key; valid keys here: {', '.join(_keys_at(e['loc'][:-1]))}")
            else:
                problems.append(f"{key}: {e['msg']}")
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None


def _keys_at(loc: tuple) -> list[str]:
    """The keys the config takes at ``loc`` (a pydantic location whose every part names a
    nested config section, or a list index into one)."""
    model: Any = DeploymentConfig
    for part in loc:
        if isinstance(part, int) or part not in model.model_fields:  # a list index, a dict key
            continue
        annotation = model.model_fields[part].annotation
        args = [a for a in (*getattr(annotation, "__args__", ()), annotation) if isinstance(a, type)
                and issubclass(a, BaseModel)]
        model = args[0]
    return sorted(model.model_fields)


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> DeploymentConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read the config: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys")
    data.update(overrides or {})
    return parse_config(data, str(path))
