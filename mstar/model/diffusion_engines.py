"""Engine wiring shared by the diffusion families: the text-encoder node."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mstar.engine.base import StatelessEngine


def text_encoder_engine(text, load: Callable[..., nn.Module], cuda_graphs: bool = False) -> StatelessEngine:
    """The text-encoder node of a diffusion family: ``text.build_encoder()`` loaded from the
    ``text_encoder`` folder by ``load(make, folder, seed_offset, **load_options)``; every
    request's prompt tokens in one batched ``text.encode(encoder, ids, masks)``, each item
    getting its ``text`` features. ``cuda_graphs`` (checked at startup to be on CUDA):
    ``text.graphed(encoder)`` replays the forward (``text.encode(..., graphs=...)``)."""
    encoder = load(text.build_encoder, "text_encoder", 1)  # read through its checkpoint_name_map
    extra = {"graphs": text.graphed(encoder)} if cuda_graphs else {}

    return StatelessEngine(lambda op, items: [
        {"text": e} for e in text.encode(encoder, [i.inputs["prompt_ids"] for i in items],
                                         [i.inputs["prompt_mask"] for i in items], **extra)])
