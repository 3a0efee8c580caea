"""``toy_rollout``: a test-only stateful model for the session tests, registered on import.

A request brings controls (``model_kwargs.controls``: a list of ``DIM``-float vectors); a
Loop runs one step per control, and each step updates a running state and emits it:
``h <- tanh(W h + U x + b t)``, with ``t`` the step's position in the whole session. Every
output depends on everything the session has seen, so a resumed session matches an
uninterrupted run of the same controls only if its state was kept exactly.

The engine keeps the session's state in its store (``item.session.put``) after every step:
every frame the session has made (a ``Trail``, the last frame being the running state), so
it grows by ``4 * DIM`` bytes a step as a rolling cache would (``session_store_bytes``
weighs it); a request starts from it (``item.session.get``), without a session from zeros.
``gate``: a test may clear it to hold every step (a request in flight).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from mstar.contract import GenerateSpec, OutputEvent, RequestError
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.graph import Emit, Graph, Loop, Node, Step, Walk
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest

DIM = 4
MAX_STEPS = 512


def weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (0.9 * torch.randn(DIM, DIM, generator=g) / DIM ** 0.5, torch.randn(DIM, DIM, generator=g),
            0.01 * torch.randn(DIM, generator=g))


def reference(controls: list[list[float]]) -> np.ndarray:
    """The outputs of an uninterrupted run of ``controls``: ``[len(controls), DIM]`` float32."""
    w, u, b = weights()
    h, out = torch.zeros(DIM), []
    for t, x in enumerate(torch.tensor(controls, dtype=torch.float32)):
        h = torch.tanh(w @ h + u @ x + b * t)
        out.append(h.clone())
    return torch.stack(out).numpy()


@dataclass(frozen=True)
class Trail:
    """A session's kept state: its frames so far ``[t, DIM]``; ``frames[-1]`` is the running state."""

    frames: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.frames.nbytes


class RolloutEngine(Engine):
    def __init__(self) -> None:
        self.w, self.u, self.b = weights()
        self.live: dict[str, tuple[torch.Tensor, int]] = {}  # request id -> (state, steps the session has run)
        self.gate = threading.Event()
        self.gate.set()

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        if not self.gate.wait(timeout=30):
            raise RuntimeError("the test never opened the gate")
        outputs = []
        for item in items:
            state = self.live.get(item.request_id)
            kept = item.session.get() if item.session is not None else None
            if state is None:
                state = (kept.frames[-1], len(kept.frames)) if kept is not None else (torch.zeros(DIM), 0)
            h, t = state
            x = item.inputs["controls"][item.iteration]
            h = torch.tanh(self.w @ h + self.u @ x + self.b * t)
            self.live[item.request_id] = (h, t + 1)
            if item.session is not None:
                before = kept.frames if kept is not None else torch.zeros(0, DIM)
                item.session.put(Trail(torch.cat([before, h[None]])))
            outputs.append(EngineOutput({"frame": h.clone()}))
        return outputs

    def release(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return {"live": float(len(self.live))}


class FrameStream(OutputStream):
    """Each frame as a "latent" event: DIM float32 little-endian."""

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent:
        return OutputEvent(modality="latent", data=value.numpy().astype("<f4").tobytes())


@register
class ToyRollout(ModelSpec):
    key = "toy_rollout"
    tasks = frozenset()
    generate_modalities = (frozenset(), frozenset({"latent"}))

    def graph(self) -> Graph:
        node = Node("roll", "stateless", inputs=("controls",), outputs=("frame",))
        step = Step("roll", reads="controls", writes="frame", emit=Emit("frame", "latent"))
        return Graph.build([node], [Walk("rollout", Loop(step, max_iters="steps"), inputs=("controls",))])

    def load_frontend(self) -> None:
        pass

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        controls = spec.model_kwargs.get("controls")
        if spec.files and controls is None:  # a binary append: float32 little-endian controls
            raw = b"".join(data for _, data in spec.files)
            if len(raw) % (4 * DIM):
                raise RequestError("files", f"must hold whole controls of {DIM} float32")
            controls = np.frombuffer(raw, dtype="<f4").reshape(-1, DIM).tolist()
        if (not isinstance(controls, list) or not 1 <= len(controls) <= MAX_STEPS
                or not all(isinstance(c, list) and len(c) == DIM for c in controls)):
            raise RequestError("model_kwargs.controls", f"must be a list of 1 to {MAX_STEPS} lists of {DIM} numbers")
        tensor = torch.tensor(controls, dtype=torch.float32)
        return WalkRequest("rollout", {"controls": tensor}, {"steps": len(controls)})

    def output_stream(self, request: WalkRequest, stop: list[str]) -> OutputStream:
        return FrameStream()

    def build_engines(self, nodes: set[str], device: torch.device):
        return {"roll": RolloutEngine()} if "roll" in nodes else {}
