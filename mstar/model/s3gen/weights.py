"""Loading ``S3Gen`` from the released ``s3gen.safetensors`` (Chatterbox's ``S3Token2Wav``
state dict).

The file holds four modules under four prefixes:

- ``flow.``: token embedding, speaker and encoder projections (-> ``front``), the upsampling
  conformer ``flow.encoder.`` (-> ``encoder``) and the CFM estimator ``flow.decoder.estimator.``
  (-> ``estimator``);
- ``mel2wav.``: the HiFT vocoder (-> ``vocoder``), its convolutions weight-normed
  (``parametrizations.weight.original0``/``1``), folded into plain weights on loading;
- ``speaker_encoder.``: CAMPPlus, the prompt clip's x-vector, and ``tokenizer.``: the S3 speech
  tokenizer of the prompt clip. Neither is S3Gen's: the front-end encoders load them.

``load_s3gen`` fills every parameter of ``S3Gen`` and uses every ``flow.``/``mel2wav.`` tensor
(strict both ways); the front-end prefixes are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from mstar.model.flow import estimator_name_map, flow_front_name_map
from mstar.model.s3gen.token2wav import S3Gen, S3GenConfig
from mstar.model.vocoder.weight_norm import fold_weight_norm
from mstar.model.weights import load_weights

__all__ = ["FRONT_END_PREFIXES", "S3GEN_FILES", "load_s3gen", "read_s3gen", "s3gen_name_map", "s3gen_tensors"]

FRONT_END_PREFIXES = ("speaker_encoder.", "tokenizer.")
"""Prefixes of ``s3gen.safetensors`` that belong to the prompt's front-end encoders."""

S3GEN_FILES = {False: "s3gen.safetensors", True: "s3gen_meanflow.safetensors"}
"""The file in a Chatterbox checkpoint directory, by ``meanflow`` (Turbo's is the second)."""

_VOCODER = "mel2wav."
_ENCODER = "flow.encoder."


def s3gen_name_map(name: str) -> str | None:
    """A released name (weight-norm pairs already folded) as ``S3Gen`` calls it; None for the
    front-end encoders' tensors. A name of no known part comes back unchanged, so strict
    loading reports it."""
    if name.startswith(FRONT_END_PREFIXES):
        return None
    if name.startswith(_VOCODER):
        return "vocoder." + name[len(_VOCODER):]
    if name.startswith(_ENCODER):
        return "encoder." + name[len(_ENCODER):]
    if (front := flow_front_name_map(name, "flow.")) is not None:
        return "front." + front
    if (estimator := estimator_name_map(name, "flow.decoder.estimator.")) is not None:
        return "estimator." + estimator
    return name


def s3gen_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with the vocoder's weight-norm pairs folded into plain weights
    (held until the end, since a pair's halves may come in any order); the rest pass through."""
    vocoder: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name.startswith(_VOCODER):
            vocoder[name] = tensor
        else:
            yield name, tensor
    yield from fold_weight_norm(vocoder).items()


def load_s3gen(module: S3Gen, named_tensors: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True) -> None:
    """Fill ``module`` from the released tensors (``iter_safetensors`` of the checkpoint)."""
    load_weights(module, s3gen_tensors(named_tensors), name_map=s3gen_name_map, strict=strict)


def read_s3gen(directory: str | os.PathLike[str], config: S3GenConfig | None = None,
               dtype: torch.dtype | None = None) -> S3Gen:
    """``S3Gen(config)`` (default: the released S3Gen's) filled from the S3Gen file of a
    Chatterbox checkpoint ``directory`` (``S3GEN_FILES[config.meanflow]``; the directory's
    other files are T3's and the voice encoder's), in eval mode."""
    config = config or S3GenConfig()
    path = Path(directory) / S3GEN_FILES[config.meanflow]
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {directory}")
    model = S3Gen(config)
    with safe_open(path, framework="pt") as handle:
        load_s3gen(model, ((name, handle.get_tensor(name)) for name in handle.keys()))
    return (model if dtype is None else model.to(dtype)).eval()
