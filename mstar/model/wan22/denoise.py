"""Wan2.2's denoise engine: one UniPC step of the DiT for many requests at once.

Ops (ports in brackets):

- ``step`` [latents, text, negative_text, optional condition -> latents]: a whole step; a request
  with ``guidance_scale > 1`` puts two rows in a forward (prompt and negative prompt, the
  batched pair) and combines them, ``v_uncond + g * (v_cond - v_uncond)``.
- ``velocity`` [latents, text, optional condition -> velocity]: one branch's prediction, so a
  walk can run the two branches as ``Parallel`` steps, on one rank or two (CFG parallel);
- ``guide`` [latents, v_cond, v_uncond, optional condition -> latents]: combine and step.

Rows of all requests whose latents have the same shape share DiT forwards, each at its own step
and time.

Image-to-video (TI2V, diffusers' ``expand_timesteps``): ``condition`` holds the image's
normalised latents ``[C, 1, h, w]``; the DiT sees them in place of the first latent frame, at
time 0 on those tokens, while the sampler steps the whole latents. After the last step the
first frame is the condition.

Each request's schedule (sigmas, timesteps) comes from its ``num_steps`` param; its UniPC
solver state (the last two clean-sample estimates and the last sample) stays here between
steps, keyed by request, and is freed by ``release``.

The prompt's conditioning (``encode``: the DiT's cross-attention key and value projections of
its rows' prompt features) is the same at every step. A forward whose rows' prompt tensors are those of
a forward in the last two calls (the same tensor objects in the same order: the worker hands a
request's encoded prompt over as one tensor at every step; two calls, for the branches of
``cfg_parallel`` run by turns on one rank) reuses it; it is computed again when they change.
For the 5B DiT that is 1.2 TFLOP a two-row step (30 blocks' key and value products over 512
prompt tokens), held as 30 x 2 x rows x 512 x 3072 values (377 MB for two bf16 rows). The
ranks of a split DiT decide alone (a follower's inputs are new tensors at every step), so
``encode`` must be no collective.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mstar.diffusion.guidance import guide
from mstar.diffusion.unipc import UniPC, UniPCState
from mstar.engine.base import Engine, EngineItem, EngineOutput

OPS = ("step", "velocity", "guide")

# predict(latents [B, C, F, h, w], time x 1000 [B, 1] or per token [B, N], encode(text)) -> flow
Predict = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
# encode(text [B, L, D]) -> what predict takes of the rows' prompts
Encode = Callable[[torch.Tensor], Any]


class _Prompt(NamedTuple):
    """A forward's encoded prompts, kept for the next steps with the same rows."""

    requests: set[str]  # the rows' request ids (freed with any of them)
    texts: list[torch.Tensor]  # the rows' prompt tensors, held so that their id()s stay theirs
    encoded: Any
    last_call: int  # the last call of ``_predict`` that used it


def guidance_scale(item: EngineItem) -> float:
    return float(item.params.get("guidance_scale", 1.0))


def dit_input(item: EngineItem) -> torch.Tensor:
    """The latents the DiT sees: the condition in place of the first frame for i2v."""
    latents = item.inputs["latents"]
    condition = item.inputs.get("condition")
    return latents if condition is None else torch.cat([condition.to(latents), latents[:, 1:]], dim=1)


class WanDenoiseEngine(Engine):
    def __init__(self, predict: Predict, scheduler: UniPC, patch: tuple[int, int, int], device: torch.device,
                 max_batch_size: int | None = None, encode: Encode = lambda text: text):
        self.predict = predict
        self.encode = encode
        self.prompts: dict[tuple[int, ...], _Prompt] = {}  # by the id() of each row's prompt tensor
        self.calls = 0
        self.scheduler = scheduler
        self.patch = patch
        self.device = device
        self.max_batch_size = max_batch_size
        self.schedules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.solvers: dict[str, UniPCState] = {}
        self.forward_rows: deque[int] = deque(maxlen=1024)  # rows of each recent forward (batch log)

    def _schedule(self, item: EngineItem) -> tuple[torch.Tensor, torch.Tensor]:
        if item.request_id not in self.schedules:
            self.schedules[item.request_id] = self.scheduler.timesteps(int(item.params["num_steps"]))
        return self.schedules[item.request_id]

    def _time(self, item: EngineItem, per_token: bool) -> torch.Tensor:
        """The DiT's time: per token ``[N]`` (the step's timestep, 0 on a condition frame's
        tokens) when ``per_token``, else the step's timestep alone ``[1]``, which the DiT
        broadcasts over the tokens: the same numbers, without reading a ``[N, 6, D]`` modulation
        per token in every block."""
        t = float(self._schedule(item)[1][item.iteration].float())
        # made where the DiT runs: a host tensor copied up would make the host wait for the GPU
        if not per_token:
            return torch.full((1,), t, device=self.device)
        c, f, h, w = item.inputs["latents"].shape
        pt, ph, pw = self.patch
        time = torch.full((f // pt, h // ph, w // pw), t, device=self.device)
        if "condition" in item.inputs:
            time[0] = 0.0
        return time.flatten()

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        for item in items:
            if item.op not in OPS:
                raise ValueError(f"the Wan denoise engine has no op {item.op!r} (it has {list(OPS)})")
        with torch.inference_mode():
            flows = self._predict(items)
            outputs, solvers = [], {}
            for i, item in enumerate(items):
                if item.op == "velocity":
                    outputs.append(EngineOutput({"velocity": flows[(i, "text")]}))
                    continue
                if item.op == "guide":
                    v_cond, v_uncond = (item.inputs[k].to(self.device, torch.float32) for k in ("v_cond", "v_uncond"))
                    v = guide(v_cond, v_uncond, guidance_scale(item))
                else:
                    v = flows[(i, "text")]
                    if (i, "negative_text") in flows:
                        v = guide(v, flows[(i, "negative_text")], guidance_scale(item))
                latents, solvers[item.request_id] = self._step(item, v)
                outputs.append(EngineOutput({"latents": latents}))
        self.solvers.update(solvers)  # only once the whole batch stepped
        return outputs

    def _step(self, item: EngineItem, v: torch.Tensor) -> tuple[torch.Tensor, UniPCState]:
        """The request's UniPC step with flow ``v``; after the last one, an i2v request's first
        frame is its condition."""
        sigmas, _ = self._schedule(item)
        latents = item.inputs["latents"].to(self.device, torch.float32)[None]
        state = self.solvers.get(item.request_id, UniPCState())
        latents, state = self.scheduler.step(item.iteration, sigmas, v[None], latents, state)
        latents = latents[0]
        if item.iteration == len(sigmas) - 2 and "condition" in item.inputs:
            latents = dit_input(EngineItem(item.request_id, item.op, item.iteration,
                                           {**item.inputs, "latents": latents}, item.params))
        return latents, state

    def _predict(self, items: list[EngineItem]) -> dict[tuple[int, str], torch.Tensor]:
        """Every row's flow prediction (float32): rows of one latent shape share forwards of at
        most ``max_batch_size`` rows."""
        groups: dict[tuple, list[tuple[int, str]]] = defaultdict(list)
        for i, item in enumerate(items):
            if item.op == "guide":
                continue
            texts = ["text", "negative_text"] if item.op == "step" and guidance_scale(item) > 1 else ["text"]
            if "negative_text" in texts and "negative_text" not in item.inputs:
                raise ValueError(f"request {item.request_id}: guidance_scale {guidance_scale(item)} needs a "
                                 "negative_text input")
            for text in texts:
                groups[tuple(item.inputs["latents"].shape)].append((i, text))
        out: dict[tuple[int, str], torch.Tensor] = {}
        if not groups:  # guide steps only
            return out
        self.calls += 1
        for rows in groups.values():
            size = self.max_batch_size or len(rows)
            for start in range(0, len(rows), size):
                chunk = rows[start:start + size]
                latents = torch.stack([dit_input(items[i]) for i, _ in chunk]).to(self.device)
                per_token = any("condition" in items[i].inputs for i, _ in chunk)  # an i2v row
                time = torch.stack([self._time(items[i], per_token) for i, _ in chunk])
                texts = [items[i].inputs[name] for i, name in chunk]
                key = tuple(map(id, texts))
                kept = self.prompts.get(key)
                prompt = kept.encoded if kept else self.encode(torch.stack(texts).to(self.device))
                self.prompts[key] = _Prompt({items[i].request_id for i, _ in chunk}, texts, prompt, self.calls)
                self.forward_rows.append(len(chunk))
                out.update(zip(chunk, self.predict(latents, time, prompt).float()))
        self.prompts = {key: kept for key, kept in self.prompts.items() if kept.last_call >= self.calls - 1}
        return out

    def release(self, request_id: str) -> None:
        self.schedules.pop(request_id, None)
        self.solvers.pop(request_id, None)
        self.prompts = {key: kept for key, kept in self.prompts.items() if request_id not in kept.requests}
