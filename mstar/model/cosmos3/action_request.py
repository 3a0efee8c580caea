"""Cosmos3's action requests (``mstar.model.cosmos3.action``): each request's checks, its
observation on the canvas, its starting noise and actions, as a ``WalkRequest`` of the ``act_*``
walks; and the stream that turns the emitted chunk into the client's ``action`` event.

``ActionRequests`` is a part of the ``Cosmos3`` spec: it reads the spec's ``knobs``, ``prompt``,
``latent_channels``, ``action_dim``, ``action_domains`` and ``sound`` (set by ``load_frontend``)
and uses its ``_steps_and_scale``, ``_check_sound`` and ``_clip``.

``enable_sound`` adds the soundtrack, as the pipeline's ``enable_sound`` does beside ``action``:
``sound_latents`` sized for the ``chunk + 1`` frame clip (the pipeline's ``num_frames``), their
noise drawn after the video's and before the actions', and the ``act_*_sound`` walks."""

from __future__ import annotations

import numpy as np
import torch

from mstar.contract import GenerateSpec, OutputEvent, RequestError
from mstar.model.cosmos3 import action as act
from mstar.model.cosmos3.sound import SoundLayout, SoundVideoStream
from mstar.model.spec import OutputStream, WalkRequest
from mstar.model.video_output import VideoFrames

FRAME_STEP = act.TIME_COMPRESSION


def clip_frames(chunk: int) -> int:
    """Pixel frames of a chunk's clip that the VAE codes: the pipeline's clip is ``chunk + 1``
    frames, of which the Wan2.2 VAE codes the first ``1 + 4 * (chunk // 4)`` (its encode drops the
    rest), so that many are encoded (inverse dynamics) and decoded (forward dynamics)."""
    return 1 + FRAME_STEP * (chunk // FRAME_STEP)


class ActionRequests:
    action_dim: int | None = None  # the heads' width; None: the checkpoint serves no action mode
    action_domains: int = 0
    sound: SoundLayout | None = None

    def _domain(self, name: str) -> tuple[int, int]:
        """The embodiment's ``(domain id, raw action width)``."""
        if name not in act.RAW_ACTION_DIMS or act.DOMAIN_IDS[name] >= self.action_domains:
            served = sorted(d for d in act.RAW_ACTION_DIMS if act.DOMAIN_IDS[d] < self.action_domains)
            raise RequestError("domain_name", f"unknown embodiment {name!r}; known: {served}")
        width = act.RAW_ACTION_DIMS[name]
        if width > self.action_dim:
            raise RequestError("domain_name", f"embodiment {name!r} has {width}-wide actions; the checkpoint's "
                                              f"action heads are {self.action_dim} wide")
        return act.DOMAIN_IDS[name], width

    def prepare_action(self, spec: GenerateSpec) -> WalkRequest:
        """A policy, forward- or inverse-dynamics request; every bad field a 400 naming it."""
        if self.action_dim is None:
            raise RequestError("output_modalities", f"model {self.key!r} has no action heads (the DROID policies "
                                                    "have: cosmos3_droid, cosmos3_edge_droid)")
        knobs = act.ActionKnobs.parse(spec.model_kwargs)
        outputs = set(spec.output_modalities) - {"audio"}  # the soundtrack: enable_sound's
        mode = knobs.action_mode or ("policy" if "action" in outputs else "forward_dynamics")
        if mode == "forward_dynamics" and outputs != {"video"}:
            raise RequestError("output_modalities", 'action_mode forward_dynamics outputs ["video"]')
        if mode != "forward_dynamics" and outputs not in ({"action"}, {"action", "video"}):
            raise RequestError("output_modalities", f'action_mode {mode} outputs ["action"] (and "video", the '
                                                    "predicted clip)")
        domain = knobs.domain_name or self.knobs.domain_name
        if domain is None:
            raise RequestError("domain_name", "name the embodiment (e.g. droid_lerobot)")
        domain_id, width = self._domain(domain)
        if knobs.raw_action_dim is not None and knobs.raw_action_dim != width:
            raise RequestError("raw_action_dim", f"embodiment {domain!r} has {width}-wide actions, "
                                                 f"got {knobs.raw_action_dim}")
        chunk = self.knobs.action_chunk_size if knobs.action_chunk_size is None else knobs.action_chunk_size
        if not 1 <= chunk <= self.knobs.max_action_chunk_size:
            raise RequestError("action_chunk_size", f"must be from 1 to {self.knobs.max_action_chunk_size}, "
                                                    f"got {chunk}")
        if knobs.enable_sound:
            self._check_sound()
        if not spec.text.strip():
            raise RequestError("prompt", "must not be empty")
        steps, scale = self._steps_and_scale(knobs.num_inference_steps, knobs.guidance_scale)
        frames, content_h, content_w, pixels, (height, width_px) = self._observation(spec, mode, chunk,
                                                                                      knobs.resolution_tier)
        self._check_clip_size(knobs, frames, content_h * act.SIZE_MULTIPLE, content_w * act.SIZE_MULTIPLE)
        gen = torch.Generator().manual_seed(knobs.seed if knobs.seed is not None else torch.seed() % (1 << 31))
        latents = torch.randn((1, self.latent_channels, chunk // FRAME_STEP + 1, content_h, content_w),
                              generator=gen)[0]
        sound = None
        if knobs.enable_sound:  # the pipeline's draws: the video's noise, the sound's, the actions'
            sound = torch.randn(self.sound.latent_shape(chunk + 1, float(knobs.fps)), generator=gen)
        noise = torch.randn((chunk, self.action_dim), generator=gen)
        if mode == "forward_dynamics":
            actions = act.chunk_actions(self._raw_actions(knobs, width), chunk, self.action_dim)
        else:
            actions = noise.clone()
        actions[:, width:] = 0
        caption = act.action_caption(spec.text, view_point=knobs.view_point, num_frames=chunk + 1,
                                     fps=float(knobs.fps), height=height, width=width_px)
        ids = self.prompt.chat_ids(caption)
        inputs = {"prompt_ids": ids, "latents": latents, "action_latents": actions, "cond_pixels": pixels}
        params = {"num_steps": steps, "fps": float(knobs.fps), "action_mode": mode, "action_domain": domain_id,
                  "raw_action_dim": width, "num_frames": frames}
        walk = f"act_{mode}" + ("_video" if mode != "forward_dynamics" and "video" in outputs else "")
        if scale > 1:
            inputs["negative_ids"] = self.prompt.chat_ids(knobs.negative_prompt)
            params["guidance_scale"] = scale
            walk += "_guided"
        if sound is not None:
            inputs["sound_latents"] = sound
            params["audio_samples"] = self.sound.samples(chunk + 1, float(knobs.fps))
            walk += "_sound"
        return WalkRequest(walk, inputs, params, prompt_tokens=len(ids))

    @staticmethod
    def _raw_actions(knobs: act.ActionKnobs, width: int) -> torch.Tensor:
        rows = knobs.raw_actions
        if not rows:
            raise RequestError("raw_actions", "forward_dynamics needs the actions to roll out ([T, raw_action_dim])")
        if any(len(row) != width for row in rows):
            raise RequestError("raw_actions", f"each action must have raw_action_dim ({width}) values")
        values = torch.tensor(rows, dtype=torch.float32)
        if not torch.isfinite(values).all():
            raise RequestError("raw_actions", "must be finite numbers")
        return values

    def _observation(self, spec: GenerateSpec, mode: str, chunk: int, tier: int):
        """The observation's pixels on its canvas: ``(frames out, content latent rows, columns,
        pixels [3, F, H, W], canvas (H, W))``; an image for a policy or forward dynamics (or a
        clip, of which the first frame counts), a clip for inverse dynamics."""
        from mstar.media.images import ImageError, decode_image

        field = "video" if mode == "inverse_dynamics" else "image"
        if len(spec.files) != 1:
            raise RequestError(field, f"action_mode {mode} takes one observation ("
                                      f"{'a clip' if field == 'video' else 'an image or a clip'}), "
                                      f"got {len(spec.files)} files")
        name, data = spec.files[0]
        frames, image_error = None, None
        if name != "video":
            try:
                frames = [np.asarray(decode_image(data, field=field).convert("RGB"))]
            except ImageError as err:
                if err.status == 413:
                    raise RequestError(err.field, err.message, err.status) from None
                image_error = err
            else:
                if mode == "inverse_dynamics":
                    raise RequestError("video", "inverse_dynamics infers the actions of a clip: send a video")
        if frames is None:
            latent_frames = chunk // FRAME_STEP + 1 if mode == "inverse_dynamics" else 1  # their frames
            frames = list(self._clip(data, latent_frames, field, image_error))
        if min(frames[0].shape[:2]) < act.SIZE_MULTIPLE:
            raise RequestError(field, f"the observation must be at least {act.SIZE_MULTIPLE} pixels a side")
        count = clip_frames(chunk) if mode == "inverse_dynamics" else 1
        pixels, canvas, content = act.observation_pixels(frames, count, tier)
        rows, cols = act.content_latents(content)
        return clip_frames(chunk), rows, cols, pixels, canvas

    @staticmethod
    def _check_clip_size(knobs: act.ActionKnobs, frames: int, height: int, width: int) -> None:
        """A size or frame count sent (the video routes send them) must be the clip's."""
        if knobs.width is not None and (knobs.width, knobs.height) != (width, height):
            raise RequestError("width", f"the clip is the observation's content on the {knobs.resolution_tier} "
                                        f"tier's canvas: send {width}x{height}")
        if knobs.num_frames is not None and knobs.num_frames != frames:
            raise RequestError("num_frames", f"the clip has 1 + 4 * (action_chunk_size // 4) frames: send {frames}")


class ActionChunk(OutputStream):
    """The action chunk -> one event of modality ``action``: float32 little-endian, row-major
    ``[action_chunk_size, raw_action_dim]``; the predicted clip, where asked, as ``VideoFrames``,
    and with ``audio_samples`` the soundtrack as ``SoundVideoStream`` sends it."""

    def __init__(self, audio_samples: int | None = None) -> None:
        self.chunks = 0
        self.video = VideoFrames() if audio_samples is None else SoundVideoStream(audio_samples)

    @property
    def generated(self) -> int:
        return self.chunks

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        if modality in ("video", "audio"):
            return self.video.feed(modality, value)
        self.chunks += 1
        return OutputEvent(modality="action", data=value.to(torch.float32).contiguous().numpy().tobytes())
