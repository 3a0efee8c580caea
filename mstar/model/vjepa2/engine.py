"""V-JEPA 2's node functions (``StatelessEngine``): requests whose inputs have the same shapes
run in one forward.

``vjepa2``: ``encoder`` [frames -> embeddings] and ``predictor`` [embeddings, context, target
-> predicted]. ``vjepa2_ac``: ``encoder`` [frames -> embeddings] (every frame of every request
in one forward, each frame on its own) and ``predictor`` [embeddings, actions, states,
extrinsics -> predicted]. Outputs are float32 on the host: they are emitted to the client.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from mstar.engine.base import EngineItem, StatelessEngine
from mstar.model.vjepa2.modeling import VJEPA2ACModel, VJEPA2Model

Outputs = list[dict[str, torch.Tensor]]


def by_shape(items: list[EngineItem], ports: tuple[str, ...],
             run: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Outputs:
    """``run`` once per group of items whose ``ports`` have the same shapes, on their inputs
    stacked; its outputs split back per item."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, item in enumerate(items):
        groups[tuple(tuple(item.inputs[p].shape) for p in ports)].append(i)
    out: list[dict[str, torch.Tensor] | None] = [None] * len(items)
    for indices in groups.values():
        stacked = {p: torch.stack([items[i].inputs[p] for i in indices]) for p in ports}
        result = run(stacked)
        for row, i in enumerate(indices):
            out[i] = {name: value[row].float().cpu() for name, value in result.items()}
    return out  # type: ignore[return-value]


def vjepa2_engines(model: VJEPA2Model, device: torch.device, dtype: torch.dtype) -> dict[str, StatelessEngine]:
    def encode(op: str, items: list[EngineItem]) -> Outputs:
        return by_shape(items, ("frames",),
                        lambda x: {"embeddings": model.encoder(x["frames"].to(device, dtype))})

    def predict(op: str, items: list[EngineItem]) -> Outputs:
        def run(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            hidden = x["embeddings"].to(device, dtype)
            return {"predicted": model.predictor(hidden, x["context"].to(device), x["target"].to(device))}

        return by_shape(items, ("embeddings", "context", "target"), run)

    return {"encoder": StatelessEngine(encode), "predictor": StatelessEngine(predict)}


def vjepa2_ac_engines(model: VJEPA2ACModel, device: torch.device, dtype: torch.dtype,
                      normalize: bool) -> dict[str, StatelessEngine]:
    def encode(op: str, items: list[EngineItem]) -> Outputs:
        frames = [item.inputs["frames"] for item in items]
        video = torch.cat(frames).to(device, dtype)[None]  # every frame is encoded on its own
        tokens = model.encode_frames(video, normalize=normalize)[0]
        per_frame = model.encoder.config.tokens_per_frame
        return [{"embeddings": part.float().cpu()}
                for part in tokens.split([len(f) * per_frame for f in frames])]

    def predict(op: str, items: list[EngineItem]) -> Outputs:
        def run(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            extrinsics = x["extrinsics"].to(device, dtype) if model.predictor.config.use_extrinsics else None
            out = model.predict(x["embeddings"].to(device, dtype), x["actions"].to(device, dtype),
                                x["states"].to(device, dtype), extrinsics, normalize=normalize)
            return {"predicted": out}

        return by_shape(items, ("embeddings", "actions", "states", "extrinsics"), run)

    return {"encoder": StatelessEngine(encode), "predictor": StatelessEngine(predict)}
