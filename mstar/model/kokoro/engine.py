"""Kokoro's node: one synthesis per chunk, the chunks of many requests in one batch.

Each item is one request's chunk (its loop iteration): the text halves of all items run as one
padded batch, and so do the frame halves (see ``modeling.py``); a row's harmonic-source noise
comes from a generator seeded by its request's seed and chunk index, so a request's audio does
not depend on what it was batched with.
"""

from __future__ import annotations

import torch

from mstar.engine.base import EngineItem
from mstar.model.kokoro.modeling import KokoroModel

__all__ = ["speak_fn"]

_CHUNK_SEED_STRIDE = 1_000_003


def speak_fn(model: KokoroModel):
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        rows, styles, speeds, generators = [], [], [], []
        for item in items:
            chunk = item.iteration
            length = int(item.inputs["chunk_lengths"][chunk])
            rows.append(item.inputs["chunk_ids"][chunk, :length].to(device, torch.long))
            styles.append(item.inputs["styles"][chunk].to(device, dtype))
            speeds.append(float(item.params["speed"]))
            seed = int(item.params["seed"]) * _CHUNK_SEED_STRIDE + chunk
            generators.append(torch.Generator(device).manual_seed(seed))
        ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        lengths = torch.tensor([len(r) for r in rows], device=device)
        audio, _ = model(ids, torch.stack(styles), torch.tensor(speeds, device=device, dtype=dtype), lengths,
                         generators=generators)
        return [{"audio": a.float().cpu()} for a in audio]

    return run
