"""LTX-2.5's deployment knobs: the distilled recipe has a fixed schedule (eight sigmas, no
guidance), so beyond the shared ``Knobs`` there are only the size caps checked before a
request is queued."""

from __future__ import annotations

from pydantic import Field

from mstar.model.knobs import Knobs


class LtxKnobs(Knobs):
    max_image_area: int = Field(1920 * 1088, ge=1)
    """The largest ``width * height`` a request may ask for; larger is a 400 before scheduling."""

    max_video_pixels: int = Field(1920 * 1088 * 121, ge=1)
    """The largest ``width * height * num_frames`` a request may ask for."""

    max_prompt_tokens: int = Field(1024, ge=4)
    """The prompt length the encoder pads to (a multiple of the connectors' registers)."""
