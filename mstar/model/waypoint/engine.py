"""Waypoint's engine: one node, ``world``, holding each running rollout's state.

Ops (ports in brackets):

- ``start`` [pixels -> latent]: a new ``Rollout`` for the request (seeded by its ``seed``
  parameter), the seed image encoded and appended as frame 0.
- ``frame`` [controls, latent -> frames]: the control row of this loop iteration in, one latent
  frame generated and decoded to uint8 RGB ``[time_upscale, H, W, 3]`` out.

The state between steps is the ``Rollout`` alone (``mstar.model.waypoint.rollout``), held here
by request id while its request runs and dropped by ``release``. A request with a session also
puts it in the session's store (``item.session``) at ``start``; a request that resumes the
session has no ``start`` (the model's ``resume`` walk) and its first ``frame`` takes the
rollout from the store, so its controls continue the same rollout. Rollouts run one after
another (batch 1 each, as the reference does).
"""

from __future__ import annotations

import torch

from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.model.waypoint.rollout import Rollout, WaypointWorld

START, FRAME = "start", "frame"


class WaypointEngine(Engine):
    def __init__(self, world: WaypointWorld):
        self.world = world
        self.rollouts: dict[str, Rollout] = {}

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        return [self._run(item) for item in items]

    def _run(self, item: EngineItem) -> EngineOutput:
        if item.op == START:
            self.release(item.request_id)  # a retried start starts over
            rollout = self.rollouts[item.request_id] = self.world.new_rollout(item.params["seed"])
            latent = self.world.start(rollout, item.inputs["pixels"])
            if item.session is not None:
                item.session.put(rollout)  # kept whole (it grows in place) for the session's next request
            return EngineOutput({"latent": latent.float().cpu()})
        if item.op == FRAME:
            control = item.inputs["controls"][item.iteration]
            return EngineOutput({"frames": self.world.step(self._rollout(item), control)})
        raise ValueError(f"the waypoint engine has no op {item.op!r} (it has {START!r}, {FRAME!r})")

    def _rollout(self, item: EngineItem) -> Rollout:
        """The request's rollout: its own, or on a resumed session's first step the session's."""
        rollout = self.rollouts.get(item.request_id)
        if rollout is None:
            session = item.session
            rollout = session.get() if session is not None and session.resume else None
            if rollout is None:
                raise RuntimeError(f"request {item.request_id!r} has no waypoint rollout to step (no start, and no "
                                   "session to resume)")
            self.rollouts[item.request_id] = rollout
        return rollout

    def release(self, request_id: str) -> None:
        self.rollouts.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return {"rollouts": float(len(self.rollouts))}


def control_vector(buttons: list[int], mouse: list[float], scroll: int, n_buttons: int) -> torch.Tensor:
    """A control as the DiT reads it: ``[mouse x, mouse y, buttons one-hot..., scroll sign]``."""
    vector = torch.zeros(n_buttons + 3)
    vector[0], vector[1] = float(mouse[0]), float(mouse[1])
    for button in buttons:
        vector[2 + button] = 1.0
    vector[-1] = float((scroll > 0) - (scroll < 0))
    return vector
