"""SNAC neural audio codec decoder (codes -> waveform), as used by Orpheus TTS."""

from mstar.model.snac.config import SnacConfig
from mstar.model.snac.modeling import (
    ORPHEUS_TOKENS_PER_FRAME,
    SnacDecoder,
    codes_from_orpheus,
    load_snac_state_dict,
)

__all__ = [
    "ORPHEUS_TOKENS_PER_FRAME",
    "SnacConfig",
    "SnacDecoder",
    "codes_from_orpheus",
    "load_snac_state_dict",
]
