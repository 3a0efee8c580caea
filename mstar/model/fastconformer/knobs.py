"""The transducer families' deployment knobs and request options."""

from __future__ import annotations

from pydantic import Field

from mstar.config import ConfigError
from mstar.model.knobs import CudaGraphs, RequestKnobs


class TransducerKnobs(CudaGraphs):
    """Parakeet's and Nemotron ASR's ``model_kwargs``. ``cuda_graphs``: a decode iteration is
    one replay of a CUDA graph per batch bucket (it replays the device loop)."""

    max_audio_seconds: float = Field(1800.0, gt=0, allow_inf_nan=False)
    """The longest upload, in seconds of audio; longer than ``max_clip_seconds``, it is cut into
    windows at quiet points."""

    max_clip_seconds: float = Field(610.0, gt=0, allow_inf_nan=False)
    """The longest window one request decodes, in seconds."""

    max_upload_bytes: int = Field(25 * 1024 * 1024, ge=1)
    """The largest upload, in bytes."""

    steps_per_iteration: int = Field(64, ge=1)
    """Greedy steps of a clip per decode iteration; its tokens stream out as the iteration ends."""

    device_loop: bool | None = None
    """Run a decode iteration's greedy steps with no read of the device in between (masks and
    cursors stay on the device; one read when the iteration ends). None: on when the decoder
    runs on CUDA, off on the CPU (where the reference loop, which skips finished rows, is
    faster). Both decode the same tokens."""

    def check(self, device: str) -> None:
        super().check(device)
        if self.cuda_graphs and self.device_loop is False:
            raise ConfigError("model_kwargs.cuda_graphs replays the device loop: leave model_kwargs.device_loop on")


class NemotronAsrKnobs(TransducerKnobs):
    lookahead: int | None = Field(None, ge=0)
    """The encoder's attention lookahead, in 80 ms frames: one the checkpoint was trained with
    (its processor's ``supported_num_lookahead_tokens``); None: the widest."""


class TransducerRequestKnobs(RequestKnobs):
    """``/generate``'s ``model_kwargs`` for a transducer (its one file is the audio)."""

    language: str | None = None
    """The speech's language, as the model takes it (see the model's notes); None: its default."""
