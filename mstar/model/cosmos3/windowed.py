"""Cosmos3 windowed rollouts (``window_mode`` chained or kv): a long clip made window by window.

A deployment with ``enable_windowed_video`` declares the ``windowed`` walks (``_guided`` with
a negative prompt)::

    Loop over num_windows:
        vae  window_start  [window_noise, tail_pixels -> latents, cond_latents]
        Loop over num_steps: dit step [latents, prompt_ids, (negative_ids), cond_latents -> latents]
        vae  window_decode [latents -> frames (emitted as video), tail_pixels]

Every window is a whole bidirectional denoise of ``window_frames`` pixel frames
(``1 + 4 (L - 1)``, quantized down to whole latent frames) with the video-to-video layout: its
first ``k`` latent frames are pinned clean. Window 0 is plain text-to-video (no pinned frames),
or image-/video-to-video when the request brings a file; every later window is conditioned on
the last ``p = 1 + 4 (k - 1)`` frames of the window before it, decoded to uint8 and encoded
again as a clip of their own (what a video-to-video request given those frames would encode),
``k = max(2, 1 + (overlap_frames - 1) // 4)``. Those ``p`` frames repeat the previous window's
tail, so a later window delivers only its ``window_frames - p`` new frames; the schedule is
padded to whole windows and the last window's frames trimmed to ``num_frames``.

The noise of all windows is drawn up front from one generator seeded with the request's seed,
window after window (window 0's draw is a plain request's), so a seeded request is
deterministic, and the denoise engine starts a fresh solver at each window's first step.

Sessions (``session_id``): the ``vae`` node keeps a ``WindowSession`` in the session store: the
noise stream and the latest window's uint8 frames. A session request's noise is drawn there,
window by window, from the session's generator (seeded with the opening request's seed; a
resume goes on with it and ignores its own ``seed``), so an opening and its resumes draw what
one longer rollout would. ``resume_session`` conditions window 0 on the stored frames' tail
(pinned clean like a chained overlap) and delivers only the ``num_frames`` new frames: an
opening of whole windows and a resume equal one rollout of all their windows with the opening's
seed. ``end_session`` and the timeouts are the session book's (``docs/sessions.md``).

``stream_video``: each window's frames are one ``video`` event as soon as they are decoded;
without it ``WindowedVideo`` holds them and sends the assembled clip at the end.

``window_mode: kv`` (experimental; ``mstar.model.cosmos3.kv_window``): the same walks, no
overlap. Every window is ``L`` new latent frames (``window_frames``, 29 by default: 8) in the
text-to-video layout (window 0 image-/video-conditioned when the request brings a file),
denoised attending block-causally to the committed clean K/V of the windows before it, which
the denoise node keeps per request; frames more than ``context_frames`` (61 by default, as latent frames; 0 keeps all)
behind the frontier are released. The windows' latents are one latent video, and the ``vae``
node decodes them as one: the Wan VAE is causal in time, so its decoder's state (its
``DecodeState``: every causal convolution's last input frames, the first frame's mark) is
carried from one window's decode to the next, and the frames delivered window by window, joined,
are the decode of the whole rollout's latents at once (no seam at a boundary). The rollout's
first latent frame decodes to one frame, every later one to four, so window 0 delivers
``window_frames`` (``1 + 4 (L - 1)``) frames and every later window ``4 L``; the last window is
trimmed to ``num_frames`` (frames cut from it are not delivered later: a resume goes on after
the whole window, as a chained one does; a resume may ask for ``4k`` frames, so whole windows
of ``4 L`` join with none cut). Without a session the carried state is the request's, on the ``vae``
engine, freed when the request ends; with one the denoise node keeps the committed cache in its
session store and the ``vae`` node the decoder's state in the ``WindowSession``, and a kv resume
goes on from both (``mstar.model.cosmos3.kv_window``), its window 0 delivering ``4 L`` frames
too, so an opening and its resume equal one rollout's frames. The ``vae`` node keeps the last
window's frames as well, so a chained request may resume a kv session (a chained window moves
the session's world on: it drops the carried decode, as the denoise node drops the cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mstar.contract import OutputEvent, RequestError
from mstar.graph import Emit, Loop, Sequential, Step, Walk
from mstar.model.cosmos3.conditioning import condition_length, video_pixels
from mstar.model.cosmos3.kv_window import context_latents
from mstar.model.spec import WalkRequest
from mstar.model.video_output import VideoFrames
from mstar.model.wan22.vae import DecodeState, frames_uint8

FRAME_STEP = 4
OPS = ("window_start", "window_decode")
# (window_frames, overlap_frames) when a request sends none: Edge's 61/32, 29/8 elsewhere
EDGE_DEFAULTS = (61, 32)
DEFAULTS = (29, 8)
KV_WINDOW_FRAMES = 29
KV_CONTEXT_FRAMES = 61
KV_WARNING = ("window_mode: kv is experimental: the checkpoints were not trained block-causally, so committed "
              "K/V conditions a later window far more weakly than chained's pinned frames (an image-conditioned "
              "rollout can leave the scene at the first window boundary)")


def windowed_walks() -> list[Walk]:
    walks = []
    for guided in (False, True):
        extra = ("negative_ids",) if guided else ()
        start = Step("vae", "window_start", reads=("window_noise", "tail_pixels"), writes=("latents", "cond_latents"))
        denoise = Loop(Step("dit", "step", reads=("latents", "prompt_ids", *extra, "cond_latents"), writes="latents"),
                       max_iters="num_steps", progress=True)
        decode = Step("vae", "window_decode", reads="latents", writes=("frames", "tail_pixels"),
                      emit=Emit("frames", "video"))
        body = Loop(Sequential(start, denoise, decode), max_iters="num_windows")
        walks.append(Walk("windowed" + ("_guided" if guided else ""), body,
                          inputs=("window_noise", "prompt_ids", *extra, "tail_pixels")))
    return walks


@dataclass(frozen=True)
class WindowPlan:
    """How ``num_frames`` are cut into windows."""

    window_frames: int  # pixel frames a window denoises, 1 + 4 (latent_frames - 1)
    latent_frames: int
    pinned_latents: int  # k: latent frames a later window takes from the previous one (0 in kv)
    pinned_frames: int  # p = 1 + 4 (k - 1); 0 when k is 0
    first_skip: int  # window 0's leading frames not delivered (p when resuming a session, else 0)
    num_frames: int  # delivered in all
    num_windows: int
    kv: bool = False  # window_mode kv: one latent video, its decode carried from window to window
    resumed: bool = False  # the request resumes a session (kv: window 0 goes on from its decode)

    def new_frames(self, window: int) -> int:
        """The frames window ``window`` adds: kv's carried decode gives the rollout's first latent
        frame one frame and every later one four; a chained window repeats its pinned ones."""
        if self.kv:
            return self.window_frames if window == 0 and not self.resumed else FRAME_STEP * self.latent_frames
        return self.window_frames - (self.first_skip if window == 0 else self.pinned_frames)

    def delivered(self, window: int) -> tuple[int, int]:
        """(skip, take): the frames of window ``window`` that are delivered, ``frames[skip:skip + take]``."""
        before = sum(self.new_frames(w) for w in range(window))
        skip = self.first_skip if window == 0 else self.pinned_frames
        return skip, max(0, min(self.new_frames(window), self.num_frames - before))

    def params(self) -> dict:
        return {"num_windows": self.num_windows, "window_frames": self.window_frames,
                "window_pinned_latents": self.pinned_latents, "window_first_skip": self.first_skip,
                "num_frames": self.num_frames, "window_mode": "kv" if self.kv else "chained",
                "window_resumed": self.resumed}

    @classmethod
    def of_params(cls, params: dict) -> WindowPlan:
        k = int(params["window_pinned_latents"])
        frames = int(params["window_frames"])
        return cls(frames, (frames - 1) // FRAME_STEP + 1, k, condition_length(k) if k else 0,
                   int(params["window_first_skip"]), int(params["num_frames"]), int(params["num_windows"]),
                   params.get("window_mode") == "kv", bool(params.get("window_resumed", False)))


def plan_windows(num_frames: int, window_frames: int, overlap_frames: int, *, resume: bool,
                 first_condition: int = 0, max_windows: int = 64) -> WindowPlan:
    """The windows of a chained rollout; ``RequestError`` naming the field that does not fit.
    ``first_condition``: latent frames window 0 is conditioned on (an image's 1, a clip's k)."""
    latent = (window_frames - 1) // FRAME_STEP + 1
    if latent < 3:
        raise RequestError("window_frames", f"a chained window needs at least 3 latent frames (9 pixel frames), "
                                            f"got {window_frames}")
    k = max(2, 1 + (overlap_frames - 1) // FRAME_STEP)
    if k >= latent:
        raise RequestError("overlap_frames", f"overlap_frames {overlap_frames} pins {k} latent frames, which leaves "
                                             f"none to generate in a window of {latent} (window_frames "
                                             f"{window_frames})")
    if first_condition >= latent:
        raise RequestError("condition_latent_frames", f"must be below the window's {latent} latent frames")
    frames = condition_length(latent)
    pinned = condition_length(k)
    first = frames - pinned if resume else frames
    windows = 1 + math.ceil(max(0, num_frames - first) / (frames - pinned))
    if windows > max_windows:
        raise RequestError("num_frames", f"{num_frames} frames take {windows} windows of {frames}; at most "
                                         f"{max_windows} (max_windows)")
    return WindowPlan(frames, latent, k, pinned, pinned if resume else 0, num_frames, windows, resumed=resume)


def plan_kv_windows(num_frames: int, window_frames: int, *, resume: bool = False, first_condition: int = 0,
                    max_windows: int = 64) -> WindowPlan:
    """The windows of a kv rollout, no overlap: ``window_frames`` (``1 + 4 (L - 1)``) frames in
    window 0 and ``4 L`` in every later one (a resume's window 0 too: its decode goes on)."""
    latent = (window_frames - 1) // FRAME_STEP + 1
    if latent < 2:
        raise RequestError("window_frames", f"a kv window needs at least 2 latent frames (5 pixel frames), "
                                            f"got {window_frames}")
    if first_condition >= latent:
        raise RequestError("condition_latent_frames", f"must be below the window's {latent} latent frames")
    frames, step = condition_length(latent), FRAME_STEP * latent
    first = step if resume else frames
    windows = 1 + math.ceil(max(0, num_frames - first) / step)
    if windows > max_windows:
        raise RequestError("num_frames", f"{num_frames} frames take {windows} windows of {step}; at most "
                                         f"{max_windows} (max_windows)")
    return WindowPlan(frames, latent, 0, 0, 0, num_frames, windows, kv=True, resumed=resume)


def window_noise(shape: tuple[int, ...], windows: int, seed: int) -> torch.Tensor:
    """``[windows, *shape]`` standard-normal latents from one generator, window after window."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randn(shape, generator=generator) for _ in range(windows)])


def tail_pixels(frames: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
    """The pixels a next window is conditioned on: the last ``p`` of ``uint8 [F, H, W, 3]``
    frames as a video-to-video clip ``float32 [3, p, H, W]``."""
    height, width = frames.shape[1:3]
    return video_pixels(np.asarray(frames[-plan.pinned_frames:].numpy()), width, height, plan.pinned_latents)


@dataclass
class WindowSession:
    """A windowed rollout's session state on the ``vae`` node: the noise stream (the opening
    request's generator, seeded with its seed, every window's draw taken from it in order, so a
    resume goes on with the draws a longer rollout would have taken), the latest window's
    uint8 frames ``[F, H, W, 3]`` (a chained resume's conditioning) and, while the session's
    world is a kv rollout, its decoder's carried state (a kv resume's decode goes on from it)."""

    generator: torch.Generator
    frames: torch.Tensor | None = None
    drawn: tuple[str, int, torch.Tensor] | None = None  # (request, window, noise): the last draw, reused on a re-run
    decode: DecodeState | None = None

    def draw(self, request_id: str, window: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Window ``window``'s noise: the stream's next draw (the same tensor again when the
        worker re-runs that window's start)."""
        if self.drawn is None or self.drawn[:2] != (request_id, window):
            self.drawn = (request_id, window, torch.randn(shape, generator=self.generator))
        return self.drawn[2]

    @property
    def nbytes(self) -> int:
        return (0 if self.frames is None else self.frames.nbytes) + (0 if self.decode is None else self.decode.nbytes)


def run_window_op(vae, op: str, items, dtype: torch.dtype, device: torch.device, chunk: int,
                  decodes: dict[str, DecodeState]) -> list[dict]:
    """The ``vae`` node's window ops, one item at a time (windows are few and large).
    ``decodes``: the carried decoder state of each kv rollout without a session, by request
    (the engine's; a session's is in its ``WindowSession``). A kv window decodes on from a copy
    of its rollout's state, and the states move on only once every item of the batch is done:
    a batch that fails is run again item by item (the worker finds the culprit so), and each
    window then decodes from where it began."""
    out, carried = [], []
    for item in items:
        plan = WindowPlan.of_params(item.params)
        if op == "window_start":
            out.append(_start(vae, item, plan, dtype, device))
        else:
            result, state = _decode(vae, item, plan, dtype, device, chunk, decodes)
            out.append(result)
            carried.append((item, plan, state))
    for item, plan, state in carried:
        _carry(item, plan, state, decodes)
    return out


def _session_noise(item) -> tuple[torch.Tensor, WindowSession]:
    """A session request's window noise, from the session's own stream (an opening request
    starts the stream with its seed; a resume goes on with it)."""
    session = item.session
    state = session.get()
    if item.iteration == 0 and not session.resume:
        state = WindowSession(torch.Generator().manual_seed(int(item.params["noise_seed"])))
        session.put(state)
    if not isinstance(state, WindowSession):
        raise RequestError("resume_session", f"session {session.session_id!r} holds no windowed rollout to resume")
    return state.draw(item.request_id, item.iteration, tuple(item.params["noise_shape"])), state


def _start(vae, item, plan: WindowPlan, dtype, device) -> dict:
    pixels = item.inputs["tail_pixels"]
    if item.session is None:
        noise = item.inputs["window_noise"][item.iteration]
    else:
        noise, state = _session_noise(item)
        if item.iteration == 0 and item.session.resume and plan.pinned_latents:  # chained: the kept tail
            kept = state.frames
            if kept is None:
                raise RequestError("resume_session", f"session {item.session.session_id!r} holds no frames to "
                                                     "resume (it was opened or last continued with window_mode kv)")
            if tuple(kept.shape[1:3]) != tuple(pixels.shape[2:]):
                raise RequestError("size", f"the session's frames are {kept.shape[2]}x{kept.shape[1]}, this "
                                           f"request asks for {pixels.shape[3]}x{pixels.shape[2]}")
            pixels = tail_pixels(kept, plan)
    if pixels.shape[1] == 0:  # text-to-video: nothing pinned
        return {"latents": noise, "cond_latents": noise.new_zeros((noise.shape[0], 0, *noise.shape[2:]))}
    latents = vae.normalize(vae.encode(pixels[None].to(device, dtype))).float()[0].cpu()
    return {"latents": noise, "cond_latents": latents}


def _decode(vae, item, plan: WindowPlan, dtype, device, chunk: int,
            decodes: dict[str, DecodeState]) -> tuple[dict, DecodeState | None]:
    """A window's frames (and a chained window's tail); a kv window's decode goes on from its
    rollout's carried state, returned as it leaves it (``_carry`` keeps it)."""
    x = item.inputs["latents"][None].to(device, dtype)
    state = _decode_from(item, plan, decodes).copy() if plan.kv else None
    frames = frames_uint8(vae.decode(vae.denormalize(x), chunk=chunk, state=state)[0]).cpu()
    if item.session is not None:  # the session's world state: the latest window
        session = item.session.get()
        if isinstance(session, WindowSession):
            session.frames = frames.clone()
    skip, take = plan.delivered(item.iteration)
    tail = tail_pixels(frames, plan) if plan.pinned_frames else torch.zeros(3, 0, *frames.shape[1:3])
    return {"frames": frames[skip:skip + take].contiguous(), "tail_pixels": tail}, state


def _decode_from(item, plan: WindowPlan, decodes: dict[str, DecodeState]) -> DecodeState:
    """The decoder state a kv window goes on from: a fresh one at the rollout's first window
    (an opening's window 0), else the one the window before it left (a resume's window 0: the
    session's)."""
    if item.iteration == 0 and not plan.resumed:
        return DecodeState()
    if item.session is None:
        state = decodes.get(item.request_id)
        if state is None:
            raise ValueError(f"request {item.request_id}: window {item.iteration}'s decode has no state to go on "
                             "from (the window before it was not decoded here)")
        return state
    session = item.session.get()
    state = session.decode if isinstance(session, WindowSession) else None
    if state is None:
        raise RequestError("resume_session", f"session {item.session.session_id!r} holds no kv decode to go on "
                                             "from (it was opened or last continued with window_mode chained)")
    return state


def _carry(item, plan: WindowPlan, state: DecodeState | None, decodes: dict[str, DecodeState]) -> None:
    """Keep a decoded window's carried state for the next window: the request's (dropped after
    its last window) or the session's. A chained window in a session drops the session's kv
    decode: its world moved on."""
    if item.session is None:
        if state is not None and item.iteration < plan.num_windows - 1:
            decodes[item.request_id] = state
        else:
            decodes.pop(item.request_id, None)
        return
    session = item.session.get()
    if isinstance(session, WindowSession):
        session.decode = state


class WindowedVideo(VideoFrames):
    """``stream_video``: each window's frames as their own ``video`` event; otherwise the
    windows are held and sent as one clip when the request ends."""

    def __init__(self, stream: bool) -> None:
        super().__init__()
        self.stream = stream
        self.held: list[bytes] = []

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        event = super().feed(modality, value)
        if self.stream or event is None:
            return event
        self.held.append(event.data)
        return None

    def finish(self, reason: str) -> OutputEvent | None:
        if self.stream or not self.held:
            return None
        data, self.held = b"".join(self.held), []
        return OutputEvent(modality="video", data=data)


def plan_windowed(model, spec, knobs, condition) -> WindowPlan:
    """The windows of a windowed request of ``model`` (a ``Cosmos3``), checked as
    ``check_video`` left it: each rule a ``RequestError`` naming the field (``check_video`` runs
    this too, so the video routes refuse a bad rollout before queueing it)."""
    field = "window_mode" if knobs.window_mode is not None else "stream_video" if knobs.stream_video \
        else "session_id"
    if not model.knobs.enable_windowed_video:
        raise RequestError(field, f"model {model.key!r}: windowed rollouts are off in this deployment "
                                  "(enable_windowed_video)")
    if model.distilled_sigmas is not None:
        raise RequestError(field, f"model {model.key!r}: windowed rollouts run on the UniPC sampler only")
    if knobs.enable_sound:
        raise RequestError("enable_sound", "windowed rollouts have no soundtrack")
    kv = knobs.window_mode == "kv"
    if knobs.context_frames is not None and not kv:
        raise RequestError("context_frames", "applies to window_mode kv only")
    if kv and knobs.overlap_frames is not None:
        raise RequestError("overlap_frames", "kv windows do not overlap (they read the committed K/V instead)")
    resume = spec.session is not None and spec.session.resume
    if resume and condition is not None:
        raise RequestError("image", "a resumed session continues its frames; send no image or clip")
    defaults = EDGE_DEFAULTS if model.key.startswith("cosmos3_edge") else DEFAULTS
    window = knobs.window_frames or (KV_WINDOW_FRAMES if kv else defaults[0])
    if knobs.width * knobs.height * window > model.knobs.max_video_pixels:
        raise RequestError("window_frames", f"{knobs.width}x{knobs.height}x{window} is over max_video_pixels "
                                            f"({model.knobs.max_video_pixels} pixels)")
    first = 0 if condition is None else (1 if condition[0] == "i2v" else knobs.condition_latent_frames)
    if kv:
        plan = plan_kv_windows(knobs.num_frames, window, resume=resume, first_condition=first,
                               max_windows=model.knobs.max_windows)
    else:
        plan = plan_windows(knobs.num_frames, window, knobs.overlap_frames or defaults[1], resume=resume,
                            first_condition=first, max_windows=model.knobs.max_windows)
    return plan


def prepare_windowed(model, spec, knobs, steps: int, scale: float, condition) -> WalkRequest:
    """A windowed request of ``model`` (a ``Cosmos3``), checked as ``check_video`` left it."""
    plan = plan_windowed(model, spec, knobs, condition)
    kv = knobs.window_mode == "kv"
    fps = float(knobs.fps)
    meta = dict(num_frames=plan.window_frames, height=knobs.height, width=knobs.width, fps=fps)
    ids = model.prompt.ids(spec.text, **meta)
    shape = (model.latent_channels, plan.latent_frames, knobs.height // 16, knobs.width // 16)
    seed = knobs.seed if knobs.seed is not None else torch.seed() % (1 << 31)
    pixels = condition[1] if condition is not None else torch.zeros(3, 0, knobs.height, knobs.width)
    params = {"num_steps": steps, "fps": fps, "stream_video": knobs.stream_video, **plan.params()}
    if spec.session is None:
        noise = window_noise(shape, plan.num_windows, seed)
    else:  # the vae node draws it from the session's stream (a resume continues the opening's)
        noise = torch.zeros(0)
        params |= {"noise_seed": seed, "noise_shape": list(shape)}
    inputs = {"prompt_ids": ids, "window_noise": noise, "tail_pixels": pixels}
    if kv:
        context = KV_CONTEXT_FRAMES if knobs.context_frames is None else knobs.context_frames
        params["context_latents"] = context_latents(context)
    walk = "windowed"
    if scale > 1:
        inputs["negative_ids"] = model.prompt.ids(knobs.negative_prompt, negative=True, **meta)
        params["guidance_scale"] = scale
        walk += "_guided"
    return WalkRequest(walk, inputs, params, prompt_tokens=len(ids))
