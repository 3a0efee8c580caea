"""Many-model deployments: several registered models served as one graph.

A ``ComposedSpec`` names its parts (``asr``, ``llm``, ``tts``: a registry key each, which the
deployment's ``models.<part>`` may change) and builds each part's own spec from a config of
its own (the deployment's device, dtype, load format and limits, the part's model, weights,
resources and ``model_kwargs``). Its graph is the parts' graphs side by side, every node,
walk and resource named under its part (``llm/llm``, ``llm/chat``, ``llm/kv_pages``;
``mstar.graph.compose``), so one conductor admits and schedules them all and the YAML's
``node_groups`` place each part's nodes where they should run.

``PartView`` is one part seen from the runtime: the part's own spec, whose requests it names
under the part on the way in and back on the way out. A part's spec never knows it is one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, ClassVar

import torch

from mstar.config import ConfigError, DeploymentConfig
from mstar.contract import Transcription, TranscriptionSpec
from mstar.graph import Graph
from mstar.graph.compose import compose, qualified, split_name
from mstar.model.spec import ModelSpec, OutputStream, WalkOutput, WalkRequest

__all__ = ["ComposedSpec", "PartView", "part_config"]

def part_config(deployment: DeploymentConfig, part: str, default_model: str) -> DeploymentConfig:
    """The config of one part: the deployment's shared keys, the part's own on top."""
    given = deployment.models.get(part)
    own = given.model_dump(exclude_unset=True) if given is not None else {}
    shared = deployment.model_dump(include={"load_format", "dtype", "device", "gpus", "max_seq_len",
                                            "max_concurrent_requests", "cache_dir", "tensor_comm_protocol"})
    data = shared | {"model": default_model} | {k: v for k, v in own.items() if v is not None}
    return DeploymentConfig.model_validate(data)

class ComposedSpec(ModelSpec):
    """A deployment of several models (module doc). ``parts``: part name -> default model."""

    parts: ClassVar[dict[str, str]]
    routes: ClassVar[dict[str, str]]  # task -> the part that serves it

    def __init__(self, config: DeploymentConfig):
        super().__init__(config)
        unknown = sorted(set(config.models) - set(self.parts))
        if unknown:
            raise ConfigError(f"models.{unknown[0]}: {self.key} has no part {unknown[0]!r}; its parts are "
                              f"{', '.join(self.parts)}")
        from mstar.model.registry import model_class

        self.members: dict[str, ModelSpec] = {}
        for part, default in self.parts.items():
            sub = part_config(config, part, default)
            cls = model_class(sub.model)
            if isinstance(cls, type) and issubclass(cls, ComposedSpec):
                raise ConfigError(f"models.{part}.model: {sub.model!r} is itself a many-model deployment")
            self.members[part] = cls(sub)
        self.views = {part: PartView(part, spec) for part, spec in self.members.items()}
        self.tasks = frozenset(t for t in type(self).tasks if t == "realtime" or t in self.part_for(t).tasks)

    def part_for(self, task: str) -> ModelSpec:
        return self.members[self.routes[task]]

    def view_for(self, task: str) -> PartView:
        return self.views[self.routes[task]]

    # ------------------------------------------------------------- the graph
    def graph(self) -> Graph:
        return compose({part: spec.graph() for part, spec in self.members.items()})

    def default_capacity(self) -> dict[str, int]:
        return {qualified(part, name): units for part, spec in self.members.items()
                for name, units in spec.default_capacity().items()}

    def parallel_dims(self) -> dict[str, Any]:
        return {qualified(part, node): dims for part, spec in self.members.items()
                for node, dims in spec.parallel_dims().items()}

    def load_frontend(self) -> None:
        for spec in self.members.values():
            spec.load_frontend()

    def build_engines(self, nodes: set[str], device: torch.device) -> dict[str, Any]:
        engines: dict[str, Any] = {}
        for part, spec in self.members.items():
            own = {split_name(node)[1] for node in nodes if split_name(node)[0] == part}
            if own:
                engines |= {qualified(part, node): engine for node, engine in spec.build_engines(own, device).items()}
        return engines

    def output_stream(self, request: WalkRequest, stop: list[str]) -> OutputStream:
        part, _ = split_name(request.walk)
        return self.views[part].output_stream(request, stop)

    @property
    def max_model_len(self) -> int:
        return self.part_for("chat").max_model_len if "chat" in self.routes else self.config.max_seq_len


class PartView:
    """One part of a ``ComposedSpec`` as the runtime's backend sees a model spec: the part's
    own spec, its requests' walks and resources named under the part (``llm/chat``,
    ``llm/kv_pages``) on the way in, and back to the part's own names for its output stream.
    Whatever else the backend asks of it (voices, tasks, limits) is the part's."""

    def __init__(self, part: str, spec: ModelSpec):
        self.part = part
        self.spec = spec

    def __getattr__(self, name: str) -> Any:
        if name.startswith("prepare_") or name in ("transcribe", "output_stream"):
            raise AttributeError(name)  # only those defined below: each renames what it hands on
        return getattr(self.spec, name)

    def named(self, request: WalkRequest) -> WalkRequest:
        """``request`` as the composed graph knows it."""
        return replace(request, walk=qualified(self.part, request.walk),
                       cost={qualified(self.part, k): v for k, v in request.cost.items()},
                       peak={qualified(self.part, k): v for k, v in request.peak.items()})

    def own(self, request: WalkRequest) -> WalkRequest:
        """``request`` as the part's spec made it."""
        return replace(request, walk=split_name(request.walk)[1],
                       cost={split_name(k)[1]: v for k, v in request.cost.items()},
                       peak={split_name(k)[1]: v for k, v in request.peak.items()})

    def _named(self, planned: WalkRequest | list[WalkRequest]) -> WalkRequest | list[WalkRequest]:
        return [self.named(r) for r in planned] if isinstance(planned, list) else self.named(planned)

    def prepare_chat(self, spec: Any) -> WalkRequest:
        return self.named(self.spec.prepare_chat(spec))

    def prepare_completion(self, spec: Any) -> WalkRequest:
        return self.named(self.spec.prepare_completion(spec))

    def prepare_generate(self, spec: Any) -> WalkRequest | list[WalkRequest]:
        return self._named(self.spec.prepare_generate(spec))

    @property
    def prepare_speech(self) -> Callable[[Any], Any] | None:
        prepare = getattr(self.spec, "prepare_speech", None)
        return None if prepare is None else (lambda spec: self._named(prepare(spec)))

    @property
    def prepare_image(self) -> Callable[..., Any] | None:
        prepare = getattr(self.spec, "prepare_image", None)
        return None if prepare is None else (lambda spec, index: self.named(prepare(spec, index)))

    @property
    def transcribe(self) -> Callable[..., Awaitable[Transcription]] | None:
        transcribe = getattr(self.spec, "transcribe", None)
        if transcribe is None:
            return None

        def run(spec: TranscriptionSpec, run_walk: Callable[[WalkRequest], Awaitable[WalkOutput]]):
            return transcribe(spec, lambda request: run_walk(self.named(request)))

        return run

    def output_stream(self, request: WalkRequest, stop: list[str]) -> OutputStream:
        return self.spec.output_stream(self.own(request), stop)
