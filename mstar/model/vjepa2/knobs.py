"""V-JEPA 2's deployment knobs and a request's options (``/generate``'s ``model_kwargs``)."""

from __future__ import annotations

from pydantic import Field

from mstar.contract import RequestError
from mstar.model.knobs import Knobs, RequestKnobs


class VJEPA2Knobs(Knobs):
    max_frames: int | None = Field(None, ge=1, le=1024)
    """Frames a request may send (None: the checkpoint's ``frames_per_clip``, 64 for
    vjepa2-vitl-fpc64-256). The rotary positions extrapolate in time, so more frames run, at
    quadratic attention cost."""


class VJEPA2ACKnobs(Knobs):
    max_frames: int = Field(16, ge=1, le=256)
    """Frames (time steps) a request may send; each frame is encoded on its own."""

    normalize_reps: bool = True
    """Layer-norm (no affine) the encoder's tokens and the predictor's outputs, as the 2-AC
    training and planning code does."""


def _rows(value: list[list[float]] | None, field: str, count: int, width: int) -> None:
    if value is None:
        return
    if len(value) != count or any(len(row) != width for row in value):
        raise RequestError(field, f"expected {count} rows of {width} values (one per frame), got "
                                  f"{len(value)} rows of {sorted({len(r) for r in value})} values")


class VJEPA2Request(RequestKnobs):
    """``model_kwargs`` of one ``vjepa2`` request. With ``target_tokens`` the masked predictor
    runs too and predicts the encoder's tokens at those indices (token ``i`` is frame
    ``i // grid^2`` of the tubelets, row and column ``i mod grid^2`` in raster order)."""

    target_tokens: list[int] | None = None
    """Token indices to predict (None: the encoder only)."""

    context_tokens: list[int] | None = None
    """Token indices the predictor sees (None: every token not in ``target_tokens``)."""

    def masks(self, num_tokens: int) -> tuple[list[int], list[int]] | None:
        """(context, target) checked against ``num_tokens``, or None for the encoder only."""
        if self.target_tokens is None:
            if self.context_tokens is not None:
                raise RequestError("context_tokens", "needs target_tokens")
            return None
        for field, ids in (("target_tokens", self.target_tokens), ("context_tokens", self.context_tokens)):
            if ids is None:
                continue
            if not ids:
                raise RequestError(field, "must not be empty")
            if len(set(ids)) != len(ids):
                raise RequestError(field, "has repeated indices")
            if bad := [i for i in ids if not 0 <= i < num_tokens]:
                raise RequestError(field, f"index {bad[0]} is out of range: the clip has {num_tokens} tokens")
        target = self.target_tokens
        context = self.context_tokens
        if context is None:
            chosen = set(target)
            context = [i for i in range(num_tokens) if i not in chosen]
            if not context:
                raise RequestError("target_tokens", "covers every token; no context is left (send context_tokens)")
        return context, target


class VJEPA2ACRequest(RequestKnobs):
    """``model_kwargs`` of one ``vjepa2_ac`` request: with ``actions`` (and ``states``) the
    action-conditioned predictor runs and predicts, for each frame t, the next frame's tokens
    given frames 0..t, the actions and the states."""

    actions: list[list[float]] | None = None
    """One action per frame (``[T, action_dim]``: 7 for the release, end-effector deltas and
    gripper); None: the encoder only."""

    states: list[list[float]] | None = None
    """The robot's state at each frame (``[T, action_dim]``); required with ``actions``."""

    extrinsics: list[list[float]] | None = None
    """The camera's extrinsics per frame (``[T, action_dim - 1]``), for a predictor that uses
    them; ignored otherwise."""

    def check_against(self, frames: int, action_dim: int, use_extrinsics: bool) -> bool:
        """True when the predictor runs; a ``RequestError`` naming the field when a shape is off."""
        if self.actions is None:
            for field in ("states", "extrinsics"):
                if getattr(self, field) is not None:
                    raise RequestError(field, "needs actions")
            return False
        if self.states is None:
            raise RequestError("states", "required with actions")
        _rows(self.actions, "actions", frames, action_dim)
        _rows(self.states, "states", frames, action_dim)
        if use_extrinsics and self.extrinsics is None:
            raise RequestError("extrinsics", "this predictor needs camera extrinsics per frame")
        _rows(self.extrinsics if use_extrinsics else None, "extrinsics", frames, action_dim - 1)
        return True
