"""Cosmos3's denoise engine: one UniPC step of the tower for many requests at once.

Op ``step`` [latents, prompt_ids, optional negative_ids -> latents]. On a request's first step
its prompt (and negative prompt) runs through the text pathway once; the per-layer keys and
values stay here, keyed by request, until ``release``. Each step then packs the media rows of
every request in the batch (a guided request is two rows: the prompt's and the negative
prompt's, on the same latents) into tower forwards of at most ``max_batch_size`` rows, whatever
their sizes, combines a guided pair as ``v_uncond + g (v_cond - v_uncond)`` and takes the
request's own UniPC step (its solver state stays here too).

The tower sees the sampler's timestep (UniPC's integer one; ``1000 * sigma`` for the
fixed-sigma sampler of the distilled checkpoints, whose steps read the request's
``step_noise``, ``mstar.model.cosmos3.sampler``). All latent frames are noisy in t2i and t2v.
An i2v or v2v request also carries ``cond_latents [C, k, H, W]`` (the VAE's normalised latents
of its conditioning image or clip): on its first step they replace the first ``k`` latent
frames of the starting noise, which stay clean conditions from then on (no time embedding,
their velocity zeroed, so UniPC carries them along). The fixed-sigma sampler re-noises every
frame, so after each of its steps the ``k`` frames are set back to ``cond_latents``, as the
distilled modular pipeline re-anchors them.

A request with sound (``sound_latents [sound_dim, T]``, UniPC only) carries them beside the
video: each of its rows adds the sound tokens (positions from the same time offset as the
video's), guidance combines the sound velocities as the video's, and the sound latents take
their own UniPC step on the same schedule with their own solver state (the pipeline's copy of
the scheduler); op ``step`` then writes ``sound_latents`` too.

An action request (``mstar.model.cosmos3.action``) also carries ``action_latents [T, action_dim]``
and the params ``action_mode``, ``action_domain`` and ``raw_action_dim``: its action tokens follow
its video patches (and its sound tokens, if it has sound) in every forward, guided as the video
is, and step with their own UniPC state (the pipeline's copy of the scheduler) unless all are
clean (forward dynamics); the columns past ``raw_action_dim`` are kept zero. Its ``cond_latents``
come from the VAE's encode of the padded canvas: they are cut to the latents' (content) rows and
columns. Op ``actions`` [action_latents -> action] gives the final chunk's ``raw_action_dim``
columns. A request may carry sound, actions, both or neither: each pathway keeps its own solver.

A ``window_mode: kv`` window (params ``window_mode``, ``num_windows``, ``context_latents``) reads
its rollout's committed K/V and sits at its slice of the whole rollout's positions; after its
last step a commit pass keeps its clean K/V for the next window
(``mstar.model.cosmos3.kv_window``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from mstar.contract import RequestError
from mstar.diffusion.guidance import guide
from mstar.diffusion.unipc import UniPC, UniPCState
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.model.cosmos3.kv_window import CommittedKV
from mstar.model.cosmos3.layout import (
    action_positions,
    media_offset,
    patch_grid,
    sound_positions,
    text_positions,
    video_positions,
)
from mstar.model.cosmos3.sampler import FixedSigmas
from mstar.model.cosmos3.transformer import ActionTokens, Cosmos3Transformer, MediaItem, Prediction, TextKV

OPS = ("step", "actions")


@dataclass
class Prepared:
    """A request's step-invariant parts: its texts' keys/values and its media positions, per row."""

    texts: list[TextKV]
    positions: list[torch.Tensor]
    sound_positions: list[torch.Tensor | None]
    action_positions: list[torch.Tensor] | None = None
    kv_windows: int = 0  # a kv rollout's windows this request finished


def guidance_scale(item: EngineItem) -> float:
    return float(item.params.get("guidance_scale", 1.0))


def is_kv(item: EngineItem) -> bool:
    """Whether ``item`` is a step of a ``window_mode: kv`` windowed rollout."""
    return item.params.get("window_mode") == "kv"


def combine(velocities: list[torch.Tensor], scale: float) -> torch.Tensor:
    """A row's velocity, or a guided pair's ``v_uncond + g (v_cond - v_uncond)``."""
    return velocities[0] if len(velocities) == 1 else guide(*velocities, scale)


class Cosmos3DenoiseEngine(Engine):
    def __init__(self, tower: Cosmos3Transformer, scheduler: UniPC | FixedSigmas, device: torch.device,
                 max_batch_size: int | None = None):
        self.tower = tower
        self.scheduler = scheduler
        self.device = device
        self.max_batch_size = max_batch_size
        self.prepared: dict[str, Prepared] = {}
        self.schedules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.solvers: dict[str, UniPCState] = {}
        self.sound_solvers: dict[str, UniPCState] = {}
        self.action_solvers: dict[str, UniPCState] = {}
        self.committed: dict[str, CommittedKV] = {}  # kv windowed rollouts' committed K/V
        self.forward_rows: deque[int] = deque(maxlen=1024)  # rows of each recent forward (batch log)

    def _prepare(self, item: EngineItem) -> Prepared:
        if item.request_id not in self.prepared:
            config = self.tower.config
            names = ["prompt_ids", "negative_ids"] if guidance_scale(item) > 1 else ["prompt_ids"]
            texts, positions, sounds, actions = [], [], [], []
            grid = patch_grid(config, tuple(item.inputs["latents"].shape))
            kv, resumed = None, False
            if is_kv(item):  # positions of the whole rollout; each window takes its slice
                kv, resumed = self._committed(item, len(names), grid)
                self.committed[item.request_id] = kv
                grid = (kv.position + grid[0] * int(item.params["num_windows"]), *grid[1:])
            elif item.session is not None and "num_windows" in item.params:
                item.session.drop()  # a chained window moved the session's world on: its kv cache is stale
            fps = float(item.params.get("fps", 24.0))
            sound = item.inputs.get("sound_latents")
            if sound is not None and isinstance(self.scheduler, FixedSigmas):
                raise ValueError(f"request {item.request_id}: sound runs on the UniPC sampler only")
            chunk = len(item.inputs["action_latents"]) if "action_latents" in item.inputs else 0
            for name in names:
                if name not in item.inputs:
                    raise ValueError(f"request {item.request_id}: guidance_scale {guidance_scale(item)} needs {name}")
                ids = item.inputs[name].to(self.device)
                texts.append(self.tower.encode_text(ids, text_positions(config, len(ids)).to(self.device)))
                offset = media_offset(config, len(ids))
                if kv is not None:  # a resume keeps the rollout's offsets, so its positions go on from them
                    offset = kv.offsets[len(texts) - 1] if resumed else offset
                    if not resumed:
                        kv.offsets.append(offset)
                positions.append(video_positions(config, grid, offset, fps).to(self.device))
                if sound is not None:
                    sounds.append(sound_positions(config, sound.shape[1], offset).to(self.device))
                else:
                    sounds.append(None)
                actions.append(action_positions(config, chunk, offset, fps).to(self.device))
            self.prepared[item.request_id] = Prepared(texts, positions, sounds, actions if chunk else None)
        return self.prepared[item.request_id]

    def _committed(self, item: EngineItem, rows: int, grid: tuple[int, int, int]) -> tuple[CommittedKV, bool]:
        """A kv rollout's committed cache: the session's on a resume (whether it resumed), else a
        new one, kept in the session store when the request names a session."""
        session, keep = item.session, int(item.params["context_latents"])
        if session is not None and session.resume:
            kv = session.get()
            if not isinstance(kv, CommittedKV):
                raise RequestError("resume_session", f"session {session.session_id!r} holds no kv rollout (it was "
                                                     "opened or last continued with window_mode chained); resume "
                                                     "it chained")
            if kv.per_frame != grid[1] * grid[2]:
                raise RequestError("size", f"the session's kv rollout has {kv.per_frame} patches a latent frame, "
                                           f"this request {grid[1] * grid[2]} (its size must be the session's)")
            if len(kv.layers) != rows:
                kv.with_rows(rows)
            kv.keep = keep
            return kv, True
        kv = CommittedKV(rows, grid[1] * grid[2], keep)
        if session is not None:
            session.put(kv)  # grows in place as the windows commit
        return kv, False

    def _schedule(self, item: EngineItem) -> tuple[torch.Tensor, torch.Tensor]:
        if item.request_id not in self.schedules:
            if isinstance(self.scheduler, FixedSigmas):
                self.schedules[item.request_id] = self.scheduler.timesteps()
            else:
                self.schedules[item.request_id] = self.scheduler.timesteps(int(item.params["num_steps"]))
        return self.schedules[item.request_id]

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        for item in items:
            if item.op not in OPS:
                raise ValueError(f"the Cosmos3 denoise engine has no op {item.op!r} (it has {list(OPS)})")
        if all(item.op == "actions" for item in items):
            return [EngineOutput({"action": item.inputs["action_latents"][:, :int(item.params["raw_action_dim"])]
                                  .float().cpu().contiguous()}) for item in items]
        if any(item.op == "actions" for item in items):
            steps = [i for i, item in enumerate(items) if item.op == "step"]
            rest = [i for i, item in enumerate(items) if item.op != "step"]
            out = dict(zip(steps, self.run([items[i] for i in steps])))
            out.update(zip(rest, self.run([items[i] for i in rest])))
            return [out[i] for i in range(len(items))]
        with torch.inference_mode():
            rows: list[tuple[int, MediaItem]] = []
            states = []
            for i, item in enumerate(items):
                prepared = self._prepare(item)
                latents, clean = self._latents(item)
                actions = self._actions(item)
                states.append((latents, clean, actions))
                timestep = float(self._schedule(item)[1][item.iteration])
                noisy = list(range(0 if clean is None else clean.shape[1], latents.shape[1]))
                sound = item.inputs.get("sound_latents")
                sound = None if sound is None else sound.to(self.device, torch.float32)
                kv = self.committed.get(item.request_id)
                for j, (text, pos, sound_pos) in enumerate(zip(prepared.texts, prepared.positions,
                                                               prepared.sound_positions)):
                    chunk = None
                    if actions is not None:
                        chunk = ActionTokens(actions[0], actions[1], int(item.params["action_domain"]),
                                             prepared.action_positions[j])
                    row = MediaItem(latents, timestep, noisy, pos, text, chunk, sound, sound_pos)
                    if kv is not None:
                        row.positions, row.past = kv.window_positions(pos, latents.shape[1]), kv.past(j)
                    rows.append((i, row))
            predictions = self._predict([row for _, row in rows])
            per_item: dict[int, list[Prediction]] = {}
            for (i, _), prediction in zip(rows, predictions):
                per_item.setdefault(i, []).append(prediction)
            outputs, solvers, sound_solvers, action_solvers = [], {}, {}, {}
            for i, item in enumerate(items):
                scale = guidance_scale(item)
                v = combine([p.video.float() for p in per_item[i]], scale)
                latents, solvers[item.request_id] = self._step(item, v, *states[i][:2])
                out = {"latents": latents}
                if "sound_latents" in item.inputs:
                    v = combine([p.sound.float() for p in per_item[i]], scale)
                    out["sound_latents"], sound_solvers[item.request_id] = self._sound_step(item, v)
                if states[i][2] is not None:
                    width = int(item.params["raw_action_dim"])
                    va = combine([p.action.float() for p in per_item[i]], scale)
                    va[:, width:] = 0
                    out["action_latents"], action_solvers[item.request_id] = self._action_step(item, va,
                                                                                               *states[i][2])
                outputs.append(EngineOutput(out))
            self._commit([(item, out.outputs["latents"]) for item, out in zip(items, outputs)
                          if is_kv(item) and item.iteration == int(item.params["num_steps"]) - 1])
        self.solvers.update({k: v for k, v in solvers.items() if v is not None})  # once the whole batch stepped
        self.sound_solvers.update(sound_solvers)
        self.action_solvers.update({k: v for k, v in action_solvers.items() if v is not None})
        return outputs

    def _commit(self, finished: list[tuple[EngineItem, torch.Tensor]]) -> None:
        """The commit pass of kv windows whose last step was just taken: the finished latents as
        clean frames (no time embedding) through the tower, each guidance row keeping its K/V.
        A rollout's last window commits nothing (no window reads it), unless a session keeps
        the cache for a resume."""
        rows, owners = [], []
        for item, latents in finished:
            kv = self.committed[item.request_id]
            prepared = self.prepared[item.request_id]
            prepared.kv_windows += 1
            if prepared.kv_windows >= int(item.params["num_windows"]) and item.session is None:
                continue
            for j, (text, pos) in enumerate(zip(prepared.texts, prepared.positions)):
                rows.append(MediaItem(latents, 0.0, [], kv.window_positions(pos, latents.shape[1]), text,
                                      past=kv.past(j), keep=[]))
            owners.append((kv, len(prepared.texts), latents.shape[1]))
        if not rows:
            return
        self._predict(rows)
        start = 0
        for kv, count, frames in owners:
            kv.commit([row.keep for row in rows[start:start + count]], frames)
            start += count

    def _actions(self, item: EngineItem) -> tuple[torch.Tensor, list[int]] | None:
        """An action request's chunk (float32) and its noisy rows; None for a video request."""
        if "action_latents" not in item.inputs:
            return None
        if isinstance(self.scheduler, FixedSigmas):
            raise ValueError(f"request {item.request_id}: the distilled checkpoints serve no action modes")
        actions = item.inputs["action_latents"].to(self.device, torch.float32)
        clean = item.params.get("action_mode") == "forward_dynamics"
        return actions, [] if clean else list(range(len(actions)))

    def _action_step(self, item: EngineItem, v: torch.Tensor, actions: torch.Tensor,
                     noisy: list[int]) -> tuple[torch.Tensor, UniPCState | None]:
        """The chunk's own UniPC step (none when every action is a condition)."""
        if not noisy:
            return actions, None
        sigmas, _ = self._schedule(item)
        state = self.action_solvers.get(item.request_id, UniPCState())
        actions, state = self.scheduler.step(item.iteration, sigmas, v[None], actions[None], state)
        actions = actions[0]
        actions[:, int(item.params["raw_action_dim"]):] = 0
        return actions, state

    def _predict(self, rows: list[MediaItem]) -> list[Prediction]:
        size = self.max_batch_size or len(rows)
        out = []
        for start in range(0, len(rows), size):
            chunk = rows[start:start + size]
            self.forward_rows.append(len(chunk))
            out += self.tower.predict(chunk)
        return out

    def _sound_step(self, item: EngineItem, v: torch.Tensor) -> tuple[torch.Tensor, UniPCState]:
        sigmas, _ = self._schedule(item)
        sound = item.inputs["sound_latents"].to(self.device, torch.float32)[None]
        state = self.sound_solvers.get(item.request_id, UniPCState())
        sound, state = self.scheduler.step(item.iteration, sigmas, v[None], sound, state)
        return sound[0], state

    def _latents(self, item: EngineItem) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's latents (float32; on the first step of a conditioned request, the noise
        with its first frames replaced by the conditions) and the clean conditions (None: t2v)."""
        latents = item.inputs["latents"].to(self.device, torch.float32)
        if "cond_latents" not in item.inputs:
            return latents, None
        clean = item.inputs["cond_latents"].to(self.device, torch.float32)
        if "action_mode" in item.params:  # encoded on the canvas: keep the content's rows and columns
            clean = clean[:, :, :latents.shape[2], :latents.shape[3]]
        if clean.shape[1] > latents.shape[1] or clean.shape[2:] != latents.shape[2:] \
                or clean.shape[0] != latents.shape[0]:
            raise ValueError(f"request {item.request_id}: cond_latents {tuple(clean.shape)} do not fit the "
                             f"latents {tuple(latents.shape)}")
        if item.iteration == 0:
            latents = latents.clone()
            latents[:, :clean.shape[1]] = clean
        return latents, clean

    def _step(self, item: EngineItem, v: torch.Tensor, latents: torch.Tensor,
              clean: torch.Tensor | None) -> tuple[torch.Tensor, UniPCState | None]:
        sigmas, _ = self._schedule(item)
        if isinstance(self.scheduler, FixedSigmas):
            i = item.iteration
            noise = item.inputs["step_noise"][i].to(self.device, torch.float32)
            sigma, sigma_next = sigmas[i].to(self.device), sigmas[i + 1].to(self.device)
            latents = self.scheduler.step(latents, v, sigma, sigma_next, noise)
            if clean is not None:  # the stochastic step re-noised the conditions: re-anchor them
                latents[:, :clean.shape[1]] = clean
            return latents, None
        latents = latents[None]
        # a fresh solver at every first step: a windowed rollout's windows are denoises of their own
        state = UniPCState() if item.iteration == 0 else self.solvers.get(item.request_id, UniPCState())
        latents, state = self.scheduler.step(item.iteration, sigmas, v[None], latents, state)
        return latents[0], state

    def release(self, request_id: str) -> None:
        self.prepared.pop(request_id, None)
        self.schedules.pop(request_id, None)
        self.solvers.pop(request_id, None)
        self.sound_solvers.pop(request_id, None)
        self.action_solvers.pop(request_id, None)
        self.committed.pop(request_id, None)
