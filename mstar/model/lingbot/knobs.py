"""LingBot-World's deployment knobs (``model_kwargs`` of the YAML) and a request's options."""

from __future__ import annotations

from pydantic import Field

from mstar.model.knobs import Knobs, RequestKnobs


class LingbotKnobs(Knobs):
    assets_path: str | None = None
    """A diffusers-layout Wan2.1 checkpoint holding ``text_encoder/``, ``tokenizer/`` and
    ``vae/`` (None: the release directory when it holds them, else Wan-AI/Wan2.1-T2V-1.3B-Diffusers)."""

    window_frames: int | None = Field(None, ge=1)
    """Latent frames a chunk attends to, itself included (None: the release's ``local_attn_size``,
    whose -1 means every frame so far)."""

    sink_frames: int | None = Field(None, ge=0)
    """The first latent frames kept in the window whatever its size (None: the release's)."""

    chunk_frames: int = Field(3, ge=1)
    """Latent frames generated together (the distilled model's 3)."""

    max_image_area: int = Field(832 * 480, ge=1)
    """The largest ``width * height`` a request may ask for."""

    max_frames: int = Field(4077, ge=1)
    """The longest video a request may ask for, in frames (4077: the DiT's 1024 rotary frame
    positions, cut to whole chunks)."""


class LingbotRequest(RequestKnobs):
    """``/generate``'s ``model_kwargs`` for a LingBot-World rollout."""

    height: int = Field(480, ge=1)
    width: int = Field(832, ge=1)
    num_frames: int = Field(81, ge=1)
    seed: int | None = None
    fps: int = Field(16, ge=1, le=240)  # playback rate only
    camera_poses: list[list[list[float]]] | None = None
    """Camera-to-world poses, one per video frame (OpenCV axes), ``[F, 4, 4]`` or ``[F, 3, 4]``;
    None: a still camera."""
    intrinsics: list[float] | None = None
    """``[fx, fy, cx, cy]`` in pixels of the output size (None: a 60-degree horizontal view)."""
