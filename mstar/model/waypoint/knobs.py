"""Waypoint's deployment knobs and a rollout request's options (``/generate``'s ``model_kwargs``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from mstar.model.knobs import Knobs, RequestKnobs

Finite = Annotated[float, Field(allow_inf_nan=False)]


class WaypointKnobs(Knobs):
    max_frames: int = Field(512, ge=1)
    """The most controls (generated latent frames) one request may send; the model's frame
    context (``n_frames`` in its config, 512 for Waypoint-1.5) caps it too, the seed frame
    taking one."""


class Control(BaseModel):
    """One step's controller input, as world_engine's ``CtrlInput``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    buttons: list[int] = Field(default_factory=list)
    """Ids of the buttons held down (keys and mouse buttons), each below the model's ``n_buttons``."""

    mouse: list[Finite] = Field(default_factory=lambda: [0.0, 0.0], min_length=2, max_length=2)
    """Mouse velocity ``[x, y]``."""

    scroll: int = Field(0, ge=-1, le=1)
    """Scroll wheel: -1 back, 0 still, 1 forward."""


class WaypointRequest(RequestKnobs):
    """``model_kwargs`` of one rollout request: the controls, one per generated latent frame."""

    controls: list[Control] = Field(min_length=1)
    """One control per step; each step makes one latent frame (``time_upscale`` RGB frames)."""

    seed: int | None = Field(None, ge=0)
    """The seed of the rollout's noise (None: a fresh one)."""
