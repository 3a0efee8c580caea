"""Chatterbox TTS served: text + a voice -> T3 speech tokens -> S3Gen + PerTh -> 24 kHz audio.

Three registry keys, one class each over the same code: ``chatterbox`` (English T3),
``chatterbox_multilingual`` (23 languages, ``language_id``) and ``chatterbox_turbo`` (GPT-2
T3, mean-flow S3Gen, no guidance).

Graph: ``t3`` (autoregressive, ``T3Engine``: a guided request's conditional and
unconditional rows decode as two KV sequences of one batch) writes a speech ``token`` per
step; a stream edge hands the token stream to ``s3gen`` (stateless: S3Gen, then the
watermark), which emits audio. By default the edge waits for T3 to stop and hands over the
whole utterance (``WholeStream``: the reference's path). A ``stream: true`` request takes the
``tts_stream`` walk instead, whose edge hands over growing chunks as the tokens come
(``GrowingTokens``, see ``streaming``), unless ``stream_chunk_tokens`` is 0.

Preparing a request (API-server side): the voice (the checkpoint's built-in one, a preset from
``voices_dir``, or a cloned ``ref_audio`` clip, each encoded once per content through the
``VoiceCloning`` memo), the text ids, and the request's options, checked.
"""

from __future__ import annotations

import logging
import secrets

import numpy as np
import torch

from mstar.contract import GenerateSpec, RequestError, SpeechSpec, Voice, VoiceClip
from mstar.engine.base import StatelessEngine
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, StreamEdge, Walk
from mstar.graph.chunking import Chunk, ChunkPolicy, GrowingChunks
from mstar.model.chatterbox import checkpoint as ckpt
from mstar.model.chatterbox.knobs import LANGUAGES, ChatterboxGenerateKnobs, ChatterboxKnobs, ChatterboxSpeechKnobs
from mstar.model.chatterbox.synthesis import S3GEN_RATE, clip_voice, s3gen_fn
from mstar.model.chatterbox.t3_engine import T3Engine
from mstar.model.decoding import kv_pages
from mstar.model.perth import PerthWatermarker
from mstar.model.registry import register
from mstar.model.sentences import SentenceChunker
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.speech_output import PcmStream, check_speech_generate
from mstar.model.voice_cloning import VoiceCloning, VoicePresets

__all__ = ["Chatterbox", "ChatterboxMultilingual", "ChatterboxTurbo", "GrowingTokens", "WholeStream"]

log = logging.getLogger(__name__)

BUILTIN = "default"
PIECES = SentenceChunker(limit=400)  # characters: groups of whole sentences
MAX_PIECES = 32
VOICE_INPUTS = ("speaker_emb", "prompt_tokens", "s3_tokens", "s3_mel", "xvector")
SAMPLING_DEFAULTS = {
    "english": dict(temperature=0.8, top_p=1.0, min_p=0.05, repetition_penalty=1.2),
    "multilingual": dict(temperature=0.8, top_p=1.0, min_p=0.05, repetition_penalty=2.0),
    "turbo": dict(temperature=0.8, top_p=0.95, top_k=1000, repetition_penalty=1.2),
}
"""The reference's ``generate`` defaults per variant."""
FIRST_CHUNK_TOKENS = {"english": 35, "multilingual": 15, "turbo": 15}
"""A streamed request's first chunk (35 tokens: 1.4 s of audio) by variant."""


class WholeStream(ChunkPolicy):
    """One chunk, the whole stream, once the producer has finished: whole-utterance synthesis."""

    def next_chunk(self, available, taken, covered, closed):
        if not closed or available <= covered:
            return None
        return Chunk(taken, covered, available, covered, available, True)


class GrowingTokens(ChunkPolicy):
    """Chunks of ``first``, then ``then``, ``then * growth``, ... new tokens (at most
    ``max_size``), each handed every token so far (S3Gen's streamed chunk picks its own
    window). A chunk before the end always leaves a token for the last one, so the end is
    never a chunk that thought it was not last."""

    def __init__(self, first: int, then: int, growth: float, max_size: int) -> None:
        self.first = first
        self.later = GrowingChunks(then, growth, max(then, max_size))

    def size_of(self, index: int) -> int:
        return self.first if index == 0 else self.later.size_of(index - 1)

    def next_chunk(self, available, taken, covered, closed):
        want = self.size_of(taken)
        if closed and available > covered:
            return Chunk(taken, 0, available, covered, available, True)
        if not closed and available - covered > want:
            return Chunk(taken, 0, covered + want, covered, covered + want, False)
        return None


class ChatterboxFamily(VoiceCloning, ModelSpec):
    tasks = frozenset({"speech"})
    sample_rate = S3GEN_RATE
    Knobs = ChatterboxKnobs
    knobs: ChatterboxKnobs
    default_variant = "english"

    @property
    def variant(self) -> str:
        return self.knobs.variant or self.default_variant

    def graph(self) -> Graph:
        t3 = Node("t3", "autoregressive", inputs=("speaker_emb", "prompt_tokens", "text_ids", "token"),
                  outputs=("token",), ops=("prefill", "decode"), flags=("stop",))
        s3gen = Node("s3gen", "stateless", inputs=("token", "s3_tokens", "s3_mel", "xvector"), outputs=("audio",))
        speak = Sequential(
            Step("t3", "prefill", reads=("speaker_emb", "prompt_tokens", "text_ids"), writes="token"),
            Loop(Step("t3", "decode", reads="token", writes="token"), until="stop", max_iters="max_decode_steps"),
        )
        walks = [Walk(name, speak, inputs=(*VOICE_INPUTS, "text_ids"), streams=[self._vocode(policy)])
                 for name, policy in (("tts", WholeStream()), ("tts_stream", self._stream_policy()))]
        return Graph.build([t3, s3gen], walks)

    @staticmethod
    def _vocode(policy: ChunkPolicy) -> StreamEdge:
        return StreamEdge("token", into=Step("s3gen", reads=("token", "s3_tokens", "s3_mel", "xvector"),
                                             writes="audio", emit=Emit("audio", "audio")), policy=policy)

    def _stream_policy(self) -> ChunkPolicy:
        """A streamed request's chunks; ``stream_chunk_tokens: 0``: whole utterances."""
        k = self.knobs
        if k.stream_chunk_tokens == 0:
            return WholeStream()
        first = k.stream_first_chunk_tokens or FIRST_CHUNK_TOKENS[self.variant]
        return GrowingTokens(first, k.stream_chunk_tokens, k.stream_chunk_growth, k.stream_max_chunk_tokens)

    # -------------------------------------------------------------- frontend
    @property
    def dummy(self) -> bool:
        return self.config.load_format == "dummy"

    def checkpoint(self) -> ckpt.ChatterboxCheckpoint:
        path = self.config.model_path
        if not self.dummy:
            from mstar.model.weights import resolve_model_path

            path = resolve_model_path(path or self.default_weights, cache_dir=self.config.cache_dir)
        return ckpt.ChatterboxCheckpoint(path, self.variant, dummy=self.dummy,
                                         tiny=self.knobs.dummy_scale == "tiny", seed=self.knobs.seed)

    def load_frontend(self) -> None:
        parts = self.checkpoint()
        self.t3_config = parts.t3_config()
        self.text_front = parts.text_front()
        self.encoders = parts.clip_encoders()
        self.builtin = parts.builtin_voice()
        self.presets = VoicePresets(self.knobs.voices_dir, None) if self.knobs.voices_dir else None

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    def voices(self) -> list[str]:
        return [BUILTIN, *(self.presets.names if getattr(self, "presets", None) else [])]

    def voice_list(self) -> list[Voice]:
        language = "en" if self.variant != "multilingual" else None
        return [Voice(BUILTIN, language), *(self.presets.voices() if getattr(self, "presets", None) else [])]

    conditions_on_text = False  # the voice is the clip's audio alone

    def condition_on_clip(self, samples: np.ndarray, sample_rate: int, ref_text: str | None) -> ckpt.Voice:
        return clip_voice(self.encoders, samples, sample_rate, self.t3_config)

    def prepare_speech(self, spec: SpeechSpec) -> WalkRequest:
        if spec.speed != 1.0:
            raise RequestError("speed", "Chatterbox cannot change its speaking rate; send speed 1.0")
        options = ChatterboxSpeechKnobs.parse(spec.model_kwargs)
        return self._pieces(spec.input, self._voice(spec.voice, spec.reference), options, spec.sentence_chunking,
                            spec.stream)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        check_speech_generate(self.key, spec, clones=True)
        options = ChatterboxGenerateKnobs.parse(spec.model_kwargs)
        return self._pieces(spec.text, self._voice(options.voice, spec.reference), options, options.sentence_chunking,
                            spec.stream)

    def _pieces(self, text: str, voice: ckpt.Voice, options: ChatterboxSpeechKnobs,
                sentence_chunking: bool | None, stream: bool = False) -> WalkRequest | list[WalkRequest]:
        """One walk for the whole text (the reference's way), or with ``sentence_chunking``
        one per group of sentences, played in order: T3's quality drops on long text well
        before its limit. A streamed request's walks vocode in chunks (``tts_stream``)."""
        walk = "tts_stream" if stream else "tts"
        if not sentence_chunking:
            return self._speak(text, voice, options, walk)
        pieces = PIECES.split(text)
        if len(pieces) > MAX_PIECES:
            raise RequestError("input", f"makes {len(pieces)} sentence pieces; the limit is {MAX_PIECES}")
        return [self._speak(piece, voice, options, walk) for piece in pieces] or self._speak(text, voice, options, walk)

    def _voice(self, name: str | None, reference: VoiceClip | None) -> ckpt.Voice:
        """The request's voice: a clone of ``reference``, else a preset, else the built-in."""
        if reference is not None:
            return self.clip_conditioning(reference)
        if name in (None, BUILTIN):
            return self.builtin
        if self.presets is not None and name in self.presets:
            return self.clip_conditioning(self.presets.clip(name))
        raise RequestError("voice", f"unknown voice {name!r}; voices are {', '.join(self.voices())}")

    def _speak(self, text: str, voice: ckpt.Voice, options: ChatterboxSpeechKnobs, walk: str = "tts") -> WalkRequest:
        """The ``walk`` (``tts`` or ``tts_stream``) of one utterance."""
        if not text.strip():
            raise RequestError("input", "must contain text, not only whitespace")
        language = self._language(options.language_id)
        try:
            text_ids = self.text_front.ids(text, language)
        except ValueError as err:
            raise RequestError("input", str(err)) from None
        limit = self.knobs.max_new_tokens_limit
        asked = options.max_new_tokens or options.max_tokens
        if asked is not None and asked > limit:
            field = "max_new_tokens" if options.max_new_tokens else "max_tokens"
            raise RequestError(field, f"{asked} is over this deployment's max_new_tokens_limit {limit}")
        config = self.t3_config
        budget = min(asked or limit, config.max_speech_tokens)
        sent = options.model_dump(include={"temperature", "top_p", "top_k", "min_p", "repetition_penalty"},
                                  exclude_none=True)
        sampling = {**SAMPLING_DEFAULTS[self.variant], **sent}
        if options.seed is not None:
            sampling["seed"] = options.seed
        seed = options.seed if options.seed is not None else secrets.randbelow(2**31)
        guided = config.guided and options.cfg_weight > 0.0
        rows = 2 if guided else 1
        cond_rows = 1 + (config.perceiver.queries if config.perceiver else voice.prompt_tokens.shape[1]) \
            + (1 if config.emotion_adv else 0)
        prompt = cond_rows + len(text_ids) + 2
        pages = rows * kv_pages(prompt + budget + 1, self.config)
        if pages > self.config.resources.kv_cache.max_num_pages:
            raise RequestError("max_new_tokens", f"needs {pages} KV pages; the deployment has "
                               f"{self.config.resources.kv_cache.max_num_pages}")
        watermark = self.knobs.watermark if options.watermark is None else options.watermark
        inputs = {"speaker_emb": voice.speaker_emb, "prompt_tokens": voice.prompt_tokens,
                  "text_ids": torch.tensor(text_ids, dtype=torch.long), "s3_tokens": voice.s3gen.tokens,
                  "s3_mel": voice.s3gen.mel, "xvector": voice.s3gen.xvector}
        params = {"sampling": sampling, "cfg_weight": options.cfg_weight if config.guided else 0.0,
                  "exaggeration": options.exaggeration, "max_new_tokens": budget,
                  "max_decode_steps": budget - 1, "seed": seed, "watermark": watermark}
        return WalkRequest(walk, inputs, params, {"kv_pages": pages}, prompt_tokens=len(text_ids),
                           peak={"kv_pages": pages})

    def _language(self, language_id: str | None) -> str | None:
        if self.variant != "multilingual":
            if language_id not in (None, "en"):
                raise RequestError("language_id", f"model {self.key!r} speaks English; language_id is for "
                                   "chatterbox_multilingual")
            return None
        language = (language_id or self.knobs.default_language).lower()
        if language not in LANGUAGES:
            raise RequestError("language_id", f"unknown language {language_id!r}; one of {', '.join(LANGUAGES)}")
        return language

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PcmStream:
        return PcmStream(S3GEN_RATE)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        parts = self.checkpoint()
        engines = {}
        if "t3" in nodes:
            dtype = self.config.torch_dtype() if device.type == "cuda" else torch.float32
            model = parts.t3(device, dtype)
            kv = self.config.resources.kv_cache
            engines["t3"] = T3Engine(model, kv.max_num_pages, kv.page_size, dtype)
        if "s3gen" in nodes:
            s3gen = parts.s3gen(device)
            engines["s3gen"] = StatelessEngine(s3gen_fn(s3gen, parts.t3_config(), self._watermarker(parts, device),
                                                             self.knobs.stream_context_tokens))
        return engines

    def _watermarker(self, parts: ckpt.ChatterboxCheckpoint, device: torch.device) -> PerthWatermarker | None:
        if not self.knobs.watermark:
            return None
        try:
            import soxr  # noqa: F401  (PerTh marks at 32 kHz: the reference resamples with soxr)
        except ImportError:
            log.warning("chatterbox: soxr is not installed, so outputs are NOT watermarked (pip install soxr)")
            return None
        net = parts.perth(self.knobs.perth_path, device)
        if net is None:
            log.warning("chatterbox: no perth_path, so outputs are NOT watermarked")
            return None
        return PerthWatermarker(net)


@register
class Chatterbox(ChatterboxFamily):
    key = "chatterbox"
    default_weights = "ResembleAI/chatterbox"
    default_variant = "english"


@register
class ChatterboxMultilingual(ChatterboxFamily):
    key = "chatterbox_multilingual"
    default_weights = "ResembleAI/chatterbox"
    default_variant = "multilingual"


@register
class ChatterboxTurbo(ChatterboxFamily):
    key = "chatterbox_turbo"
    default_weights = "ResembleAI/chatterbox-turbo"
    default_variant = "turbo"
