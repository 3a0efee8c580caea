"""Positions of the FLUX.2 DiT's tokens on its four rotary axes (t, h, w, l): text tokens count
along l, latent tokens index their grid on h and w, reference image ``i`` sits at time
``10 * (i + 1)`` (``mstar.model.flux2.edit``)."""

from __future__ import annotations

import functools

import torch

from mstar.model.flux2.edit import reference_ids


def text_ids(length: int) -> torch.Tensor:
    """Positions of text tokens on FLUX.2's four rotary axes (t, h, w, l): l counts tokens."""
    ids = torch.zeros(length, 4, dtype=torch.int64)
    ids[:, 3] = torch.arange(length)
    return ids


def image_ids(rows: int, cols: int) -> torch.Tensor:
    """Positions of latent tokens (t, h, w, l): h and w index the token grid row-major."""
    ids = torch.zeros(rows * cols, 4, dtype=torch.int64)
    ids[:, 1] = torch.arange(rows).repeat_interleave(cols)
    ids[:, 2] = torch.arange(cols).repeat(rows)
    return ids


def token_ids(params: dict) -> torch.Tensor:
    """Positions of a request's DiT tokens: its image grid, then its references (if any)."""
    ids = image_ids(params["rows"], params["cols"])
    grids = params.get("reference_grids")
    return torch.cat([ids, reference_ids(grids)]) if grids else ids


def token_layout(params: dict) -> tuple:
    """What a request's ``token_ids`` depend on (a cache key)."""
    return params["rows"], params["cols"], tuple(tuple(g) for g in params.get("reference_grids") or ())


class DeviceIds:
    """The DiT's position ids on the device, made once per layout of a batch's rows and text
    length (``ids_cache`` layouts kept): a fresh host-to-device copy every step would make
    the host wait for the GPU's previous step before it could launch this one."""

    def __init__(self, device: torch.device, ids_cache: int = 64):
        self.device = device
        self._make = functools.lru_cache(maxsize=ids_cache)(self._build)

    def _build(self, layouts: tuple, text_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [{"rows": r, "cols": c, "reference_grids": [list(g) for g in grids]} for r, c, grids in layouts]
        image = torch.stack([token_ids(p) for p in rows]).to(self.device, non_blocking=True)
        return image, text_ids(text_length).to(self.device, non_blocking=True)

    def __call__(self, params: list[dict], text_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._make(tuple(token_layout(p) for p in params), text_length)
