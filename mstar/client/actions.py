"""Robot actions for ``MStarClient``: ``act`` asks a policy (Pi0.5) for an action chunk through
``/generate`` (``output_modalities=["action"]``), as a mixin.

    >>> chunk = client.act(images=["base.png", "wrist.png"], state=[0.1, -0.2, 0.0, 0.3],
    ...                    prompt="pick up the red cube", seed=0)
    >>> chunk.shape, chunk.actions[0]      # (50, 7), the first action
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mstar.client.images import ImageInput, _image_upload


@dataclass
class ActionResult:
    """An action chunk: ``actions`` (``shape[0]`` rows of ``shape[1]`` floats, unnormalised,
    in the robot's units), the same floats as float32 bytes in ``data``, and the raw answer."""

    actions: list[list[float]]
    shape: tuple[int, int]
    data: bytes
    raw: dict

    def to_numpy(self):
        import numpy as np

        return np.frombuffer(self.data, dtype="<f4").reshape(self.shape).copy()


class ActionsMixin:
    """``MStarClient``'s robot-policy method."""

    if TYPE_CHECKING:  # provided by MStarClient

        def _json(self, method: str, url: str, **kwargs: Any) -> Any: ...

    def act(
        self,
        *,
        images: Sequence[ImageInput],
        state: Sequence[float],
        prompt: str = "",
        seed: int | None = None,
        num_inference_steps: int | None = None,
        embodiment: str | None = None,
    ) -> ActionResult:
        """One observation -> one action chunk. ``images``: the cameras' frames (paths or
        encoded bytes), in the policy's camera order; ``state``: the robot's state as it
        reads it; ``prompt``: the task."""
        kwargs: dict[str, Any] = {"state": [float(v) for v in state]}
        for key, value in (("seed", seed), ("num_inference_steps", num_inference_steps),
                           ("embodiment", embodiment)):
            if value is not None:
                kwargs[key] = value
        form = {"text": prompt, "output_modalities": json.dumps(["action"]), "streaming": "false",
                "model_kwargs": json.dumps(kwargs)}
        files = [("files", _image_upload(item, i)) for i, item in enumerate(images)]
        raw = self._json("POST", "/generate", data=form, files=files)
        rows, width = raw["action_shape"]
        return ActionResult(actions=raw["action"], shape=(rows, width), data=base64.b64decode(raw["data"]["action"]),
                            raw=raw)
