"""The denoise engine: one flow-matching step of a DiT for many requests at once.

A request's loop-carried state is its latent tokens, which travel as a walk variable, and
the loop's iteration index, which the runtime hands to every step; the schedule (sigmas,
timesteps) is a pure function of the request's parameters, kept per request. DiT rows with
the same latent and text shapes run as one forward, each at its own step.

Classifier-free guidance comes in two forms, both ending in the same arithmetic:

- **batched pair**: op ``step`` of a request whose ``guidance_scale`` param is above 1 and
  which reads ``negative_text`` puts two rows in the forward (conditional and
  unconditional), combines them (``mstar.diffusion.guidance.guide``) and takes the Euler step.
- **parallel branches**: op ``velocity`` runs one row and writes the raw prediction, so a
  walk can run ``Parallel(velocity on text -> v_cond, velocity on negative_text -> v_uncond)``
  on one rank or two, then op ``guide`` combines ``v_cond`` and ``v_uncond`` and steps.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.diffusion.guidance import guide
from mstar.engine.base import Engine, EngineItem, EngineOutput

# velocity(latents [B, N, C], text [B, L, D], timesteps [B] in [0, 1], params of each row) -> [B, N, C]
Velocity = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[dict]], torch.Tensor]

STEP, VELOCITY, GUIDE = "step", "velocity", "guide"
OPS = (STEP, VELOCITY, GUIDE)


@dataclass(frozen=True)
class _Row:
    """One DiT row of a forward: item ``item``'s latents with the text in input ``text``."""

    item: int
    text: str  # "text" (conditional) or "negative_text" (unconditional)


def guidance_scale(item: EngineItem) -> float:
    return float(item.params.get("guidance_scale", 1.0))


class DenoiseEngine(Engine):
    """Ops (ports in brackets; request params ``num_steps`` and ``image_seq_len`` fix the
    schedule, ``guidance_scale`` the guidance):

    - ``step`` [latents, text, optional negative_text -> latents]: a whole Euler step; guided
      as a batched pair when ``guidance_scale > 1``.
    - ``velocity`` [latents, text -> velocity]: the DiT's prediction for one branch.
    - ``guide`` [latents, v_cond, v_uncond -> latents]: combine two branches and step.

    ``max_batch_size`` caps the rows of one DiT forward (a guided ``step`` counts two); the
    rest run in further forwards. None: every row of one shape in one forward.
    """

    def __init__(self, velocity: Velocity, scheduler: FlowMatchEuler, device: torch.device, dtype: torch.dtype,
                 max_batch_size: int | None = None):
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.velocity = velocity
        self.scheduler = scheduler
        self.device = device
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.schedules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.forward_rows: deque[int] = deque(maxlen=1024)  # rows of each recent forward (batch log)

    def _schedule(self, item: EngineItem) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's (sigmas, timesteps), on the device from its first step on: a step
        then only indexes them there (a host-to-device copy per step would wait for the
        GPU to finish the previous step before this one could be launched)."""
        if item.request_id not in self.schedules:
            steps, seq_len = int(item.params["num_steps"]), int(item.params["image_seq_len"])
            self.schedules[item.request_id] = tuple(  # type: ignore[assignment]
                _to_device(s, self.device) for s in self.scheduler.timesteps(steps, seq_len))
        return self.schedules[item.request_id]

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        for item in items:
            if item.op not in OPS:
                raise ValueError(f"the denoise engine has no op {item.op!r} (it has {list(OPS)})")
        with torch.inference_mode():
            return self._run(items)

    def _run(self, items: list[EngineItem]) -> list[EngineOutput]:
        predicted = self._predict(items, self._rows(items))
        outputs: list[EngineOutput | None] = [None] * len(items)
        moves: dict[int, torch.Tensor] = {}  # item -> the velocity its Euler step takes
        for i, item in enumerate(items):
            if item.op == VELOCITY:
                outputs[i] = EngineOutput({"velocity": predicted[_Row(i, "text")]})
            elif item.op == GUIDE:
                v_cond, v_uncond = (_to_device(item.inputs[k], self.device) for k in ("v_cond", "v_uncond"))
                moves[i] = guide(v_cond, v_uncond, guidance_scale(item))
            elif _Row(i, "negative_text") in predicted:
                moves[i] = guide(predicted[_Row(i, "text")], predicted[_Row(i, "negative_text")], guidance_scale(item))
            else:
                moves[i] = predicted[_Row(i, "text")]
        for i, latents in self._euler(items, moves).items():
            outputs[i] = EngineOutput({"latents": latents})
        return outputs  # type: ignore[return-value]

    def _rows(self, items: list[EngineItem]) -> list[_Row]:
        """The DiT rows the items need: one per ``velocity`` or unguided ``step``, two per
        guided ``step`` (the pair sits side by side)."""
        rows = []
        for i, item in enumerate(items):
            if item.op == GUIDE:
                continue
            rows.append(_Row(i, "text"))
            if item.op == STEP and guidance_scale(item) > 1:
                if "negative_text" not in item.inputs:
                    raise ValueError(f"request {item.request_id}: guidance_scale {guidance_scale(item)} needs "
                                     "a negative_text input to the step")
                rows.append(_Row(i, "negative_text"))
        return rows

    def _predict(self, items: list[EngineItem], rows: list[_Row]) -> dict[_Row, torch.Tensor]:
        """Every row's velocity (in its latents' dtype): rows of one shape share forwards of
        at most ``max_batch_size`` rows."""
        groups: dict[tuple, list[_Row]] = defaultdict(list)
        for row in rows:
            item = items[row.item]
            groups[(tuple(item.inputs["latents"].shape), tuple(item.inputs[row.text].shape))].append(row)
        out: dict[_Row, torch.Tensor] = {}
        for group in groups.values():
            size = self.max_batch_size or len(group)
            for start in range(0, len(group), size):
                chunk = group[start:start + size]
                for row, v in zip(chunk, self._forward(items, chunk)):
                    out[row] = v
        return out

    def _forward(self, items: list[EngineItem], rows: list[_Row]) -> torch.Tensor:
        batch = [items[row.item] for row in rows]
        t = torch.stack([self._schedule(item)[1][item.iteration] for item in batch]) / 1000
        latents = _to_device(torch.stack([item.inputs["latents"] for item in batch]), self.device)
        text = _to_device(torch.stack([item.inputs[row.text] for item, row in zip(batch, rows)]), self.device)
        text = text.to(self.dtype)
        self.forward_rows.append(len(rows))
        v = self.velocity(latents.to(self.dtype), text, t.to(self.dtype), [item.params for item in batch])
        return v.to(latents.dtype)

    def _euler(self, items: list[EngineItem], moves: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """One Euler step for every item in ``moves``, batched by latent shape."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i in moves:
            groups[tuple(items[i].inputs["latents"].shape)].append(i)
        out: dict[int, torch.Tensor] = {}
        for indices in groups.values():
            batch = [items[i] for i in indices]
            sigmas = [self._schedule(item)[0] for item in batch]
            sigma = torch.stack([s[item.iteration] for s, item in zip(sigmas, batch)])
            sigma_next = torch.stack([s[item.iteration + 1] for s, item in zip(sigmas, batch)])
            latents = _to_device(torch.stack([item.inputs["latents"] for item in batch]), self.device)
            stepped = FlowMatchEuler.step(latents, torch.stack([moves[i] for i in indices]), sigma, sigma_next)
            out.update(zip(indices, stepped))
        return out

    def release(self, request_id: str) -> None:
        self.schedules.pop(request_id, None)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without making the host wait for the device's queued work: a
    host tensor bound for a GPU goes through pinned memory (PyTorch's cached pinned blocks,
    kept until the copy is done), whose copy is queued like a kernel; a copy from pageable
    memory can stall the host once it outgrows the driver's staging buffer."""
    if tensor.device.type == "cpu" and torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
