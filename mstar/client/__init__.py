"""Python client for an M* server."""

from mstar.client.sdk import (
    ChatEvent,
    ChatResult,
    GenerateEvent,
    GenerateResult,
    MStarClient,
    MStarError,
    SpeechResult,
    SpeechStream,
    TranscriptionResult,
)

__all__ = [
    "ChatEvent",
    "ChatResult",
    "GenerateEvent",
    "GenerateResult",
    "MStarClient",
    "MStarError",
    "SpeechResult",
    "SpeechStream",
    "TranscriptionResult",
]
