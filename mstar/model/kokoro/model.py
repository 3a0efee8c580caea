"""Kokoro-82M TTS: text (G2P'd) or phonemes + a voice (or blend) + speed -> 24 kHz speech.

One stateless node, ``kokoro``, and one walk: a Loop over the request's chunks (whole
sentences packed to a phoneme budget, the first short), each iteration synthesising one chunk
and emitting its audio, so ``stream=True`` plays sentence by sentence. Chunks of concurrent
requests at the same step run as one batch.

Preparing a request (API-server side): the voice table (a blend is the weighted mean), the
G2P (misaki's, per language, when installed), the chunking, and per chunk its ids and its style row (the
voice table's row for the chunk's phoneme count).
"""

from __future__ import annotations

import torch

from mstar.contract import GenerateSpec, RequestError, SpeechSpec, Voice
from mstar.engine.base import StatelessEngine
from mstar.graph import Emit, Graph, Loop, Node, Step, Walk
from mstar.model.kokoro.checkpoint import KokoroCheckpoint, dummy_config, dummy_model
from mstar.model.kokoro.config import KokoroConfig
from mstar.model.kokoro.engine import speak_fn
from mstar.model.kokoro.knobs import KokoroGenerateKnobs, KokoroKnobs, KokoroSpeechKnobs
from mstar.model.kokoro.phonemes import G2P, chunk_phonemes, to_ids
from mstar.model.kokoro.voices import VoiceBank
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.speech_output import PcmStream, check_speech_generate
from mstar.model.vocoder.istftnet import use_fused_kernels

__all__ = ["Kokoro"]

SAMPLE_RATE = 24000
DEFAULT_VOICE = "af_heart"
MAX_CHUNKS = 64
VOICE_LANGUAGES = {"a": "en-US", "b": "en-GB", "e": "es", "f": "fr", "h": "hi", "i": "it", "p": "pt-BR",
                   "j": "ja", "z": "zh"}
"""A voice's language by its first letter (Kokoro's ``lang_code``), as a BCP 47 tag."""


@register
class Kokoro(ModelSpec):
    key = "kokoro"
    tasks = frozenset({"speech"})
    default_weights = "hexgrad/Kokoro-82M"
    sample_rate = SAMPLE_RATE
    validates_speech_options = True  # voice blends and speed are checked here, not by the route
    Knobs = KokoroKnobs
    knobs: KokoroKnobs

    def graph(self) -> Graph:
        node = Node("kokoro", "stateless", inputs=("chunk_ids", "chunk_lengths", "styles"), outputs=("audio",),
                    ops=("speak",))
        speak = Loop(Step("kokoro", "speak", reads=("chunk_ids", "chunk_lengths", "styles"), writes="audio",
                          emit=Emit("audio", "audio")), max_iters="num_chunks")
        return Graph.build([node], [Walk("tts", speak, inputs=("chunk_ids", "chunk_lengths", "styles"))])

    # -------------------------------------------------------------- frontend
    @property
    def dummy(self) -> bool:
        return self.config.load_format == "dummy"

    def checkpoint(self) -> KokoroCheckpoint:
        return KokoroCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def model_config(self) -> KokoroConfig:
        return dummy_config(self.knobs.dummy_config) if self.dummy else self.checkpoint().config()

    def load_frontend(self) -> None:
        self.kokoro_config = self.model_config()
        if self.dummy:
            self.voice_bank = VoiceBank.dummy(self.kokoro_config.voice_dim, seed=self.knobs.seed)
        else:
            ckpt = self.checkpoint()
            self.voice_bank = VoiceBank(ckpt.voice_names(), ckpt.voice)
        self.g2p = G2P(espeak_fallback=self.knobs.espeak_fallback)

    def voices(self) -> list[str]:
        """The voices of the loaded frontend (none before ``load_frontend``)."""
        bank = getattr(self, "voice_bank", None)
        return list(bank.names) if bank is not None else []

    def voice_list(self) -> list[Voice]:
        """The voices with the language their first letter names (/v1/audio/voices)."""
        return [Voice(name, VOICE_LANGUAGES.get(name[:1])) for name in self.voices()]

    def prepare_speech(self, spec: SpeechSpec) -> WalkRequest:
        options = KokoroSpeechKnobs.parse(spec.model_kwargs)
        return self._speak(spec.input, spec.voice, spec.speed, options, spec.sentence_chunking is not False)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        check_speech_generate(self.key, spec)
        options = KokoroGenerateKnobs.parse(spec.model_kwargs)
        return self._speak(spec.text, options.voice, options.speed, options, options.sentence_chunking is not False)

    def _speak(self, text: str, voice: str | None, speed: float, options: KokoroSpeechKnobs,
               sentence_chunking: bool = True) -> WalkRequest:
        """The ``tts`` walk over the chunks of ``text`` (or of ``options.phonemes``); without
        ``sentence_chunking`` the chunks are as long as the window allows."""
        voice = voice or (DEFAULT_VOICE if DEFAULT_VOICE in self.voice_bank.names else self.voice_bank.names[0])
        table = self.voice_bank.blend(voice)
        if not 0.25 <= speed <= 4.0:
            raise RequestError("speed", f"{speed:g} is outside 0.25 to 4.0")
        if options.phonemes is not None:
            phonemes = options.phonemes
        else:
            if not text.strip():
                raise RequestError("input", "must contain text, not only whitespace")
            lang = self.knobs.lang_code or options.lang_code or voice[0]
            phonemes = self.g2p(text, lang)
        config = self.kokoro_config
        limit = config.max_input_tokens - 2
        chunks = [c for c in chunk_phonemes(phonemes, limit, self.knobs.chunk_target_phonemes,
                                            self.knobs.first_chunk_target_phonemes, sentence_chunking)
                  if to_ids(c, config.vocab)]
        field = "phonemes" if options.phonemes is not None else "input"
        if not chunks:
            raise RequestError(field, "has no phoneme Kokoro can speak")
        if len(chunks) > MAX_CHUNKS:
            raise RequestError(field, f"makes {len(chunks)} chunks of speech; the limit is {MAX_CHUNKS}")
        rows = [torch.tensor([0, *to_ids(c, config.vocab), 0], dtype=torch.long) for c in chunks]
        styles = torch.stack([VoiceBank.style(table, len(r) - 2) for r in rows])
        return WalkRequest(
            "tts",
            {"chunk_ids": torch.nn.utils.rnn.pad_sequence(rows, batch_first=True),
             "chunk_lengths": torch.tensor([len(r) for r in rows]),
             "styles": styles},
            {"num_chunks": len(rows), "speed": float(speed), "seed": options.seed or 0},
            prompt_tokens=sum(len(r) for r in rows),
        )

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PcmStream:
        return PcmStream(SAMPLE_RATE)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        if "kokoro" not in nodes:
            return {}
        config = self.model_config()
        if self.dummy:
            model = dummy_model(config, device, seed=self.knobs.seed)
        else:
            model = self.checkpoint().load_model(device, config=config)
        use_fused_kernels(model, self.knobs.fused_kernels)
        return {"kokoro": StatelessEngine(speak_fn(model))}
