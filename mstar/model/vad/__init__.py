"""Voice activity detection: Silero VAD and the Realtime API's turn detection over it."""

from mstar.model.vad.silero import RATES, SileroVAD, VadState, load_silero_vad
from mstar.model.vad.turns import TurnDetector, TurnEvent, TurnSettings, VadStreams

__all__ = ["RATES", "SileroVAD", "TurnDetector", "TurnEvent", "TurnSettings", "VadState", "VadStreams",
           "load_silero_vad"]
