"""PerTh, the neural audio watermark Chatterbox puts on its output (``docs/perth.md``)."""

from mstar.model.perth.resample import polyphase_resample, soxr_resample
from mstar.model.perth.watermark import (
    PerthConfig,
    PerthDecoder,
    PerthEncoder,
    PerthNet,
    PerthWatermarker,
    load_perth,
    loud_frames,
    perth_name_map,
)

__all__ = [
    "PerthConfig",
    "PerthDecoder",
    "PerthEncoder",
    "PerthNet",
    "PerthWatermarker",
    "load_perth",
    "loud_frames",
    "perth_name_map",
    "polyphase_resample",
    "soxr_resample",
]
