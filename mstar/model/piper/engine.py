"""Piper's node: one sentence per item, the sentences of many requests in one padded batch.

A row's noise comes from a generator seeded by its request's seed and sentence index, drawn at
the row's own length, and the network keeps padding out of every real sample (``modeling``),
so a seeded request's audio does not depend on what it was batched with.
"""

from __future__ import annotations

import torch

from mstar.engine.base import EngineItem
from mstar.model.piper.modeling import PiperNoise, PiperVits

__all__ = ["speak_fn"]

_SENTENCE_SEED_STRIDE = 1_000_003


def speak_fn(model: PiperVits):
    device = next(model.parameters()).device

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        rows, generators, speakers = [], [], []
        scales: dict[str, list[float]] = {"noise_scale": [], "length_scale": [], "noise_w": []}
        for item in items:
            sentence = item.iteration
            length = int(item.inputs["sentence_lengths"][sentence])
            rows.append(item.inputs["sentence_ids"][sentence, :length].to(device, torch.long))
            for key, values in scales.items():
                values.append(float(item.params[key]))
            speakers.append(int(item.params["speaker"]))
            seed = int(item.params["seed"]) * _SENTENCE_SEED_STRIDE + sentence
            generators.append(torch.Generator(device).manual_seed(seed))
        ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        lengths = torch.tensor([len(r) for r in rows], device=device)
        as_tensor = {k: torch.tensor(v, device=device) for k, v in scales.items()}
        out = model(ids, lengths, noise=PiperNoise(generators=generators),
                    speakers=torch.tensor(speakers, device=device), **as_tensor)
        return [{"audio": out.audio[b, :int(out.lengths[b])].float().cpu()} for b in range(len(items))]

    return run
