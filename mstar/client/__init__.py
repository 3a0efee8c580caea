"""Python client for an M* server."""

from mstar.client.actions import ActionResult, ActionsMixin
from mstar.client.images import ImageInput, ImagesMixin
from mstar.client.realtime import RealtimeConnection
from mstar.client.sdk import (
    ChatEvent,
    ChatResult,
    GenerateEvent,
    GenerateResult,
    MStarClient,
    MStarError,
    TranscriptionResult,
)
from mstar.client.speech import SpeechMixin, SpeechResult, SpeechStream
from mstar.client.videos import VideoResult, VideosMixin

__all__ = [
    "ActionResult",
    "ActionsMixin",
    "ChatEvent",
    "ChatResult",
    "GenerateEvent",
    "GenerateResult",
    "ImageInput",
    "ImagesMixin",
    "MStarClient",
    "MStarError",
    "RealtimeConnection",
    "SpeechMixin",
    "SpeechResult",
    "SpeechStream",
    "TranscriptionResult",
    "VideoResult",
    "VideosMixin",
]
