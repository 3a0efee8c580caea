"""``toy_cloner``: a test-only speech model that clones, registered on import, for the tests of
the shared voice-cloning surface (the real families wire the same hook).

Its "conditioning" of a clip is ``[rms, frequency]``: the clip's RMS becomes the output's
amplitude, and the frequency is ``100 Hz + 10 Hz * len(ref_text)`` plus the clip's rate in
kHz, so a test can hear which clip (and which transcript) a request was conditioned on.
Every call of ``condition_on_clip`` is recorded in ``conditioned``. Text is spoken as
sentence pieces (``SentenceChunker(limit=60, first_target=20)``), one walk each, so a long
request exercises the memo across its pieces: each piece is a sine of ``SAMPLES_PER_CHAR``
samples per character. Bundled voice: ``plain``; presets come from ``model_kwargs.voices_dir``.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from mstar.contract import GenerateSpec, RequestError, SpeechSpec, Voice, VoiceClip
from mstar.engine.base import StatelessEngine
from mstar.graph import Emit, Graph, Node, Step, Walk
from mstar.model.knobs import Knobs
from mstar.model.registry import register
from mstar.model.sentences import SentenceChunker
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.speech_output import PcmStream
from mstar.model.voice_cloning import VoiceCloning, VoicePresets

RATE = 16000
SAMPLES_PER_CHAR = 40
PLAIN = torch.tensor([0.1, 200.0])
CHUNKER = SentenceChunker(limit=60, first_target=20)


def timbre_of(samples: np.ndarray, rate: int, ref_text: str | None) -> torch.Tensor:
    rms = float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))
    return torch.tensor([rms, 100.0 + 10.0 * len(ref_text or "") + rate / 1000.0])


def sine(timbre: torch.Tensor, chars: int) -> torch.Tensor:
    t = torch.arange(chars * SAMPLES_PER_CHAR, dtype=torch.float64) / RATE
    return (timbre[0] * torch.sin(2 * torch.pi * timbre[1] * t)).float()


class ToyClonerKnobs(Knobs):
    voices_dir: str | None = None
    """Preset clips (``<name>.wav`` + ``<name>.txt``)."""


@register
class ToyCloner(VoiceCloning, ModelSpec):
    key = "toy_cloner"
    tasks = frozenset({"speech"})
    sample_rate = RATE
    clip_memo_size = 4
    Knobs = ToyClonerKnobs
    knobs: ToyClonerKnobs

    def graph(self) -> Graph:
        node = Node("voice", "stateless", inputs=("timbre", "chars"), outputs=("audio",))
        speak = Step("voice", reads=("timbre", "chars"), writes="audio", emit=Emit("audio", "audio"))
        return Graph.build([node], [Walk("tts", speak, inputs=("timbre", "chars"))])

    def load_frontend(self) -> None:
        self.conditioned: list[tuple[int, int, str | None]] = []
        self._record = threading.Lock()
        self.presets = VoicePresets(self.knobs.voices_dir, "en") if self.knobs.voices_dir else None

    def condition_on_clip(self, samples: np.ndarray, sample_rate: int, ref_text: str | None) -> torch.Tensor:
        if samples.size < sample_rate // 10:
            raise RequestError("ref_audio", "the clip is shorter than 0.1 s")
        with self._record:
            self.conditioned.append((samples.size, sample_rate, ref_text))
        return timbre_of(samples, sample_rate, ref_text)

    def voices(self) -> list[str]:
        return ["plain", *(self.presets.names if self.presets else [])]

    def voice_list(self) -> list[Voice]:
        return [Voice("plain", "en"), *(self.presets.voices() if self.presets else [])]

    def prepare_speech(self, spec: SpeechSpec) -> list[WalkRequest]:
        return self._speak(spec.input, spec.voice, spec.reference, spec.sentence_chunking)

    def prepare_generate(self, spec: GenerateSpec) -> list[WalkRequest]:
        if spec.files:
            raise RequestError("files", "toy_cloner takes text, and a voice as ref_audio")
        return self._speak(spec.text, spec.model_kwargs.get("voice"), spec.reference,
                           spec.model_kwargs.get("sentence_chunking"))

    def _timbre(self, voice: str | None, reference: VoiceClip | None) -> torch.Tensor:
        if reference is not None:  # a clone: the clip decides, the voice is ignored
            return self.clip_conditioning(reference)
        if voice in (None, "plain"):
            return PLAIN
        if self.presets is not None and voice in self.presets:
            return self.clip_conditioning(self.presets.clip(voice))
        raise RequestError("voice", f"unknown voice {voice!r}")

    def _speak(self, text: str, voice: str | None, reference: VoiceClip | None,
               sentence_chunking: bool | None) -> list[WalkRequest]:
        pieces = CHUNKER.split(text, enabled=sentence_chunking is not False)
        if not pieces:
            raise RequestError("input", "must contain text")
        # conditioned per piece, as a family that prepares each piece on its own would: the memo
        # makes every piece after the first a hit
        return [WalkRequest("tts", {"timbre": self._timbre(voice, reference), "chars": torch.tensor(len(p))}, {})
                for p in pieces]

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PcmStream:
        return PcmStream(RATE)

    def build_engines(self, nodes: set[str], device: torch.device):
        def run(op, items):
            return [{"audio": sine(item.inputs["timbre"], int(item.inputs["chars"]))} for item in items]

        return {"voice": StatelessEngine(run)} if "voice" in nodes else {}


def expected_audio(text: str, timbre: torch.Tensor, sentence_chunking: bool | None = None) -> np.ndarray:
    """What ``toy_cloner`` says for ``text`` in ``timbre``: its pieces' sines, joined."""
    pieces = CHUNKER.split(text, enabled=sentence_chunking is not False)
    return np.concatenate([sine(timbre, len(p)).numpy() for p in pieces])
