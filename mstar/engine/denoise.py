"""The denoise engine: one flow-matching step of a DiT for many requests at once.

A request's loop-carried state is its latent tokens, which travel as a walk variable, and
the loop's iteration index, which the runtime hands to every step; the schedule (sigmas,
timesteps) is a pure function of the request's parameters, kept per request. Requests with
the same latent and text shapes run as one batch, each at its own step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.engine.base import Engine, EngineItem, EngineOutput

# velocity(latents [B, N, C], text [B, L, D], timesteps [B] in [0, 1], params of each row) -> [B, N, C]
Velocity = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[dict]], torch.Tensor]


class DenoiseEngine(Engine):
    """Op ``step`` reads ``latents`` and ``text`` and writes ``latents``. Request params:
    ``num_steps`` and ``image_seq_len`` (they fix the schedule)."""

    def __init__(self, velocity: Velocity, scheduler: FlowMatchEuler, device: torch.device, dtype: torch.dtype):
        self.velocity = velocity
        self.scheduler = scheduler
        self.device = device
        self.dtype = dtype
        self.schedules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _schedule(self, item: EngineItem) -> tuple[torch.Tensor, torch.Tensor]:
        if item.request_id not in self.schedules:
            steps, seq_len = int(item.params["num_steps"]), int(item.params["image_seq_len"])
            self.schedules[item.request_id] = self.scheduler.timesteps(steps, seq_len)
        return self.schedules[item.request_id]

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        if any(item.op != "step" for item in items):
            raise ValueError("the denoise engine has one op, 'step'")
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            groups[(tuple(item.inputs["latents"].shape), tuple(item.inputs["text"].shape))].append(i)
        outputs: list[EngineOutput | None] = [None] * len(items)
        for rows in groups.values():
            batch = [items[i] for i in rows]
            schedules = [self._schedule(item) for item in batch]
            steps = [item.iteration for item in batch]
            sigma = torch.stack([s[0][k] for s, k in zip(schedules, steps)]).to(self.device)
            sigma_next = torch.stack([s[0][k + 1] for s, k in zip(schedules, steps)]).to(self.device)
            t = torch.stack([s[1][k] for s, k in zip(schedules, steps)]).to(self.device) / 1000
            latents = torch.stack([item.inputs["latents"] for item in batch]).to(self.device)
            text = torch.stack([item.inputs["text"] for item in batch]).to(self.device, self.dtype)
            with torch.inference_mode():
                v = self.velocity(latents.to(self.dtype), text, t.to(self.dtype), [item.params for item in batch])
                stepped = FlowMatchEuler.step(latents, v.to(latents.dtype), sigma, sigma_next)
            for row, i in enumerate(rows):
                outputs[i] = EngineOutput({"latents": stepped[row]})
        return outputs  # type: ignore[return-value]

    def release(self, request_id: str) -> None:
        self.schedules.pop(request_id, None)
