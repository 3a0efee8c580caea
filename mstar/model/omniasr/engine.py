"""The CTC node: every clip of a step through the encoder and the head, in length-sorted
forwards under a padded-audio budget, each clip's per-frame argmax back.

A step's clips are sorted longest first and packed greedily: a forward takes the next clip
while its rows times its longest clip stay within ``max_batch_seconds`` of audio and it holds
fewer than ``max_batch_size`` clips. Sorting keeps the padding small (neighbours are of about
the same length); the budget bounds a forward's memory, which grows with rows times length
(attention with its square).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from mstar.engine.base import EngineItem, StatelessEngine
from mstar.model.omniasr.config import SAMPLE_RATE
from mstar.model.omniasr.modeling import OmniAsrCtc


def pack(lengths: list[int], *, max_rows: int, max_samples: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into forwards: longest first, each forward's
    ``rows * longest <= max_samples`` (one clip may exceed it alone) and ``rows <= max_rows``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group and len(group) < max_rows and (len(group) + 1) * lengths[group[0]] <= max_samples:
            group.append(i)
        else:
            groups.append([i])
    return groups


@contextmanager
def exact_float32(on: bool):
    """TF32 off for the matmuls and convolutions inside (when ``on``), restored after: a
    float32 deployment asks for float32 numerics (batch-invariant transcripts)."""
    if not on:
        yield
        return
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


def ctc_fn(model: OmniAsrCtc, *, max_batch_size: int, max_batch_seconds: float):
    """The node's function: ``waveform`` (one clip, normalised, float32) in, ``frame_ids``
    (its per-frame argmax over its frames) out."""
    budget = int(max_batch_seconds * SAMPLE_RATE)

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = model.final_proj.weight
        clips = [item.inputs["waveform"].reshape(-1) for item in items]
        out: list[dict[str, torch.Tensor]] = [{} for _ in items]
        for group in pack([c.shape[0] for c in clips], max_rows=max_batch_size, max_samples=budget):
            longest = clips[group[0]].shape[0]
            waves = torch.zeros(len(group), longest, device=weight.device, dtype=weight.dtype)
            for row, i in enumerate(group):
                waves[row, :clips[i].shape[0]] = clips[i].to(weight.device, weight.dtype)
            lengths = torch.tensor([clips[i].shape[0] for i in group], device=weight.device)
            with exact_float32(weight.dtype == torch.float32 and weight.device.type == "cuda"):
                logits, frames = model(waves, lengths)
            for i, ids in zip(group, model.greedy(logits, frames)):
                out[i] = {"frame_ids": torch.tensor(ids, dtype=torch.int64)}
        return out

    return run


def ctc_engines(model: OmniAsrCtc, nodes: set[str], *, max_batch_size: int, max_batch_seconds: float):
    return {"ctc": StatelessEngine(ctc_fn(model, max_batch_size=max_batch_size,
                                         max_batch_seconds=max_batch_seconds))} if "ctc" in nodes else {}
