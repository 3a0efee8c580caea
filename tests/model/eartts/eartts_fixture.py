"""The recorded NeMo reference (``record_reference.py``: nemo-toolkit 3.0.0's speechlm2
modules under torch 2.13 / transformers 5.25) and the port built from its checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.eartts.checkpoint import EarTTS, load_checkpoint
from mstar.model.eartts.config import EarTTSConfig

FIXTURE = Path(__file__).parent / "fixtures" / "eartts_reference.pt"


def reference() -> dict:
    return torch.load(FIXTURE, weights_only=True)


def built(ref: dict) -> EarTTS:
    config = EarTTSConfig.from_speech_generation(ref["config"])
    model = EarTTS(config, text_vocab=ref["text_on"].shape[0])
    load_checkpoint(model, ref["state"].items())
    model.talker.text.on.copy_(ref["text_on"])
    model.talker.text.off.copy_(ref["text_off"])
    return model.eval()


def contiguous_meta(starts: list[int], counts: list[int], capacity: int) -> PagedAttentionMetadata:
    """Metadata for sequences ``b`` of one page each (page ``b``, ``capacity`` positions),
    with ``counts[b]`` new tokens after ``starts[b]`` cached ones."""
    positions, slots, lens, qsl = [], [], [], [0]
    for b, (start, count) in enumerate(zip(starts, counts, strict=True)):
        positions += range(start, start + count)
        slots += [b * capacity + p for p in range(start, start + count)]
        lens.append(start + count)
        qsl.append(qsl[-1] + count)
    return PagedAttentionMetadata(
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor(lens), page_table=torch.arange(len(starts))[:, None], page_size=capacity,
        host_query_start_loc=tuple(qsl), host_seq_lens=tuple(lens))
