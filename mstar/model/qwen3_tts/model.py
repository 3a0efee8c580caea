"""Qwen3-TTS served: one declaration for every 12 Hz checkpoint, the variant read from its
``config.json`` (``tts_model_type``).

Two nodes: ``talker`` (the codec LM on paged KV, the code predictor inside its decode step)
and ``codec`` (the 12 Hz decoder). The ``tts`` walk is the talker's prefill and a Loop of
decodes, each writing one codec frame; the frames stream to the codec over a ``StreamEdge``
in the reference's ramp of windows (1, 3, 8, 16 new frames, then 25, each behind up to 72
frames of left context), and its samples stream out as 24 kHz PCM.

* ``custom_voice`` (``qwen3_tts``, ``qwen3_tts_1p7b``): ``voice`` picks a built-in speaker;
  ``instructions`` is a style instruction.
* ``voice_design`` (``qwen3_tts_voicedesign``): ``instructions`` describes the voice (required).
* ``base`` (``qwen3_tts_base``): clones from ``ref_audio``. The API server encodes the clip
  once per content (``condition_on_clip``, memoised by its audio): its x-vector (the speaker
  encoder) and its 12 Hz codes (the codec's encoder). In context (the default, ``ref_text``
  required): the x-vector takes the built-in speaker's row and the clip's codes and
  transcript follow the codec prefix (``prompt.in_context_rows``); ``x_vector_only_mode``:
  the x-vector alone. A missing ``ref_text`` is a 400 naming it; a clip whose frames outgrow
  ``max_seq_len`` one naming ``ref_audio``. A preset of the deployment's ``voices_dir`` is a
  ``voice`` cloned by its x-vector.

Text of 600 characters or more (or any text with ``sentence_chunking: true``) is spoken as
ordered sentence pieces of about 400 characters, one walk each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mstar.audio.io import resample
from mstar.contract import GenerateSpec, RequestError, SpeechSpec, Voice, VoiceClip
from mstar.graph import Emit, Graph, Loop, Node, ScheduledChunks, Sequential, Step, StreamEdge, Walk
from mstar.model.decoding import decode_request
from mstar.model.qwen3_tts.checkpoint import Qwen3TTSCheckpoint
from mstar.model.qwen3_tts.codec_encoder import EncoderConfig
from mstar.model.qwen3_tts.config import Qwen3TTSConfig
from mstar.model.qwen3_tts.knobs import Qwen3TTSBaseKnobs, Qwen3TTSKnobs, Qwen3TTSSpeechKnobs
from mstar.model.qwen3_tts.prompt import assistant_text, instruct_text, language_id, languages, transcript_ids
from mstar.model.qwen3_tts.ramp import AdaptiveChunks, RampRule
from mstar.model.registry import register
from mstar.model.sentences import SentenceChunker
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.speech_output import PcmStream, check_speech_generate
from mstar.model.voice_cloning import VoiceCloning, VoicePresets

TALKER, CODEC = "talker", "codec"
SAMPLE_RATE = 24000
FRAME_MS = 80.0  # every 12 Hz checkpoint: 1920 samples a frame
MAX_INPUT_CHARS = 8192
CHUNK_FROM = 600  # characters: longer inputs are spoken as sentence pieces by default
PIECES = SentenceChunker(limit=400)
MAX_PIECES = 64
PROMPT_ROWS = 8  # the prompt's rows besides the text and the instruction: the codec prefix
# the reference's talker sampling (its generate_config.json)
DEFAULTS = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05}


@dataclass(frozen=True)
class ClipConditioning:
    """A clone clip's memoised conditioning: its x-vector ``[hidden]`` and 12 Hz codes ``[T, Q]``."""

    x_vector: torch.Tensor
    codes: torch.Tensor


@dataclass(frozen=True)
class Clone:
    """What one request clones from: an x-vector (empty: no clone), and for in-context cloning
    the clip's codes and its transcript's ids."""

    x_vector: torch.Tensor
    codes: torch.Tensor | None = None
    ref_ids: list[int] | None = None


def check_codec_encoder(encoder: EncoderConfig, tts: Qwen3TTSConfig) -> None:
    """The codec encoder's codes must be the talker's: as many codebooks, ids inside its tables."""
    talker = tts.talker
    if encoder.valid_quantizers != talker.num_code_groups or encoder.codebook_size > talker.predictor.vocab_size:
        raise ValueError(f"speech tokenizer encoder: {encoder.valid_quantizers} codebooks of "
                         f"{encoder.codebook_size} codes, but the talker takes {talker.num_code_groups} of "
                         f"{talker.predictor.vocab_size}")


def codec_policy(knobs: Qwen3TTSKnobs) -> ScheduledChunks | AdaptiveChunks:
    """The codec edge's windows: the fixed ramp, or the rate-aware one (``codec_ramp``)."""
    if knobs.codec_ramp == "fixed":
        return ScheduledChunks(tuple(knobs.codec_chunk_schedule), knobs.codec_chunk_frames, knobs.codec_left_context)
    rule = RampRule(tuple(knobs.codec_chunk_schedule), knobs.codec_chunk_frames, tuple(knobs.codec_window_sizes),
                    knobs.codec_ramp_margin, knobs.codec_ramp_typical_frames, FRAME_MS)
    return AdaptiveChunks(rule, knobs.codec_left_context)


class Qwen3TTS(ModelSpec):
    """Every Qwen3-TTS 12 Hz checkpoint; the keys differ only in their default weights."""

    tasks = frozenset({"speech"})
    sample_rate = SAMPLE_RATE
    takes_instructions = True
    Knobs = Qwen3TTSKnobs
    knobs: Qwen3TTSKnobs

    def graph(self) -> Graph:
        talker = Node(TALKER, "autoregressive", inputs=("prompt_ids", "speaker_embed", "ref_codes", "token"),
                      outputs=("token", "codes"),
                      ops=("prefill", "decode"), flags=("stop",))
        codec = Node(CODEC, "stream", inputs=("codes", "ref_codes"), outputs=("audio",))
        writes = {"token": "code0", "codes": "codes"}
        speak = Sequential(
            Step(TALKER, "prefill", reads=("prompt_ids", "speaker_embed", "ref_codes"), writes=writes),
            Loop(Step(TALKER, "decode", reads={"token": "code0"}, writes=writes),
                 until="stop", max_iters="max_decode_steps"))
        knobs = self.knobs
        policy = codec_policy(knobs)
        decode = StreamEdge("codes", into=Step(CODEC, reads=("codes", "ref_codes"), writes="audio",
                                               emit=Emit("audio", "audio")), policy=policy)
        walk = Walk("tts", speak, inputs=("prompt_ids", "speaker_embed", "ref_codes"), streams=[decode])
        return Graph.build([talker, codec], [walk])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> Qwen3TTSCheckpoint:
        return Qwen3TTSCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir,
                                         dummy=self.config.load_format == "dummy")

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.tokenizer = ckpt.tokenizer()
        self.tts: Qwen3TTSConfig = ckpt.config()
        if self.tts.clones:  # the API server encodes the clips (``condition_on_clip``)
            dummy = self.config.load_format == "dummy"
            self.speaker_encoder = ckpt.speaker_encoder("cpu", torch.float32, dummy=dummy, seed=self.knobs.seed + 2)
            self.codec_encoder = ckpt.codec_encoder("cpu", torch.float32, dummy=dummy, seed=self.knobs.seed + 3)
            check_codec_encoder(self.codec_encoder.config, self.tts)

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    def voices(self) -> list[str]:
        tts = getattr(self, "tts", None)
        return tts.speakers if tts is not None else []

    def voice_list(self) -> list[Voice]:
        return [Voice(name) for name in self.voices()]

    def prepare_speech(self, spec: SpeechSpec) -> WalkRequest | list[WalkRequest]:
        if spec.speed != 1.0:
            raise RequestError("speed", "Qwen3-TTS cannot change its speaking rate; send speed 1.0")
        options = Qwen3TTSSpeechKnobs.parse(spec.model_kwargs)
        return self._pieces(spec.input, spec.voice, options, spec.sentence_chunking, spec.reference)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest | list[WalkRequest]:
        """``/generate``: ``voice`` and ``sentence_chunking`` beside the speech options in
        ``model_kwargs``; a clone's clip arrives as ``reference``."""
        check_speech_generate(self.key, spec, clones=self.tts.clones)
        kwargs = dict(spec.model_kwargs)
        voice, chunking = kwargs.pop("voice", None), kwargs.pop("sentence_chunking", None)
        return self._pieces(spec.text, voice, Qwen3TTSSpeechKnobs.parse(kwargs), chunking, spec.reference)

    def _pieces(self, text: str, voice: str | None, options: Qwen3TTSSpeechKnobs, chunking: bool | None,
                clip: VoiceClip | None) -> WalkRequest | list[WalkRequest]:
        text = text.strip()
        if not text:
            raise RequestError("input", "must not be empty")
        if len(text) > MAX_INPUT_CHARS:
            raise RequestError("input", f"is {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
        speaker = self._voice(voice, options, clip)
        clone = self._clone(voice, clip, options) if self.tts.clones else Clone(torch.zeros(0))
        if chunking is None:
            chunking = len(text) >= CHUNK_FROM
        pieces = PIECES.split(text) if chunking else [text]
        if len(pieces) > MAX_PIECES:
            raise RequestError("input", f"makes {len(pieces)} sentence pieces; the limit is {MAX_PIECES}")
        requests = [self._speak(piece, speaker, clone, options) for piece in pieces or [text]]
        return requests[0] if len(requests) == 1 else requests

    def _voice(self, voice: str | None, options: Qwen3TTSSpeechKnobs, clip: VoiceClip | None) -> str | None:
        """The built-in speaker (CustomVoice), or None; the variant's own rules checked."""
        variant = self.tts.tts_model_type
        if variant == "base":
            return None
        if clip is not None:
            raise RequestError("ref_audio", f"{self.key} speaks with built-in or described voices; only the base "
                                            "checkpoints clone")
        if variant == "voice_design":
            if not options.instructions:
                raise RequestError("instructions", "describe the voice: VoiceDesign takes it from the instructions")
            return None
        speakers = self.tts.speakers
        name = voice or self.knobs.default_voice or (speakers[0] if speakers else None)
        if name is None or name.lower() not in speakers:
            raise RequestError("voice", f"unknown voice {name!r}; voices are {', '.join(speakers)}")
        return name.lower()

    def _clone(self, voice: str | None, clip: VoiceClip | None, options: Qwen3TTSSpeechKnobs) -> Clone:
        """The clip's conditioning (memoised by its audio): its x-vector alone
        (``x_vector_only_mode``, and a preset ``voice``), else in context with its codes and
        transcript."""
        presets = getattr(self, "presets", None)
        if clip is None and presets is not None and voice in presets:
            return Clone(self.clip_conditioning(presets.clip(voice)).x_vector)  # type: ignore[attr-defined]
        if clip is None:
            raise RequestError("ref_audio", "the base checkpoints clone a voice: send ref_audio"
                               + (f" or a preset voice ({', '.join(presets.names)})" if presets else ""))
        if not options.x_vector_only_mode and not (clip.text or "").strip():
            raise RequestError("ref_text", "send the clip's transcript (in-context cloning), or "
                                           "x_vector_only_mode: true to clone from its x-vector alone")
        cond: ClipConditioning = self.clip_conditioning(clip)  # type: ignore[attr-defined]
        if options.x_vector_only_mode:
            return Clone(cond.x_vector)
        return Clone(cond.x_vector, cond.codes, transcript_ids(self.tokenizer, clip.text.strip()))

    def _speak(self, text: str, speaker: str | None, clone: Clone, options: Qwen3TTSSpeechKnobs) -> WalkRequest:
        try:
            language_id(self.tts, options.language, speaker)
        except KeyError as err:
            raise RequestError("language", f"unknown language {options.language!r}; expected one of "
                                           f"{', '.join(languages(self.tts))}") from err
        ids = self.tokenizer(assistant_text(text), add_special_tokens=False)["input_ids"]
        instruct = (self.tokenizer(instruct_text(options.instructions), add_special_tokens=False)["input_ids"]
                    if options.instructions else [])
        # the reference's layouts: the whole text in the prefill for these variants
        non_streaming = options.non_streaming_mode if options.non_streaming_mode is not None else \
            not self.tts.clones
        rows = len(ids) + len(instruct) + PROMPT_ROWS
        if clone.codes is not None:  # at most: the transcript, bos and the clip's frames besides
            rows += len(clone.ref_ids) + len(clone.codes) + 2
        room = self.config.max_seq_len - rows
        if room < 2 and clone.codes is not None:
            raise RequestError("ref_audio", f"its {len(clone.codes)} codec frames make a {rows}-row prompt; "
                                            f"max_seq_len is {self.config.max_seq_len}: send a shorter clip")
        if room < 2:
            raise RequestError("input", f"makes a {rows}-row prompt; max_seq_len is {self.config.max_seq_len}")
        frames = min(options.max_tokens or self.knobs.max_new_frames, room)
        sampling = options.sampling(DEFAULTS, field="model_kwargs")
        codes = clone.codes if clone.codes is not None else torch.zeros(0, dtype=torch.int64)
        inputs = {"prompt_ids": torch.tensor(ids, dtype=torch.int64), "speaker_embed": clone.x_vector,
                  "ref_codes": codes}
        return decode_request("tts", inputs, rows, frames, sampling,
                              [self.tts.talker.codec_eos_token_id], self.config, upfront=True,
                              language=options.language, speaker=speaker, instruct_ids=instruct,
                              non_streaming=non_streaming, ref_ids=clone.ref_ids)

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PcmStream:
        return PcmStream(SAMPLE_RATE)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.qwen3_tts.engine import CodecEngine, talker_engine

        ckpt, dtype = self.checkpoint(), self.config.torch_dtype()
        dummy, seed = self.config.load_format == "dummy", self.knobs.seed
        kv = self.config.resources.kv_cache
        engines = {}
        if TALKER in nodes:
            talker = ckpt.talker(device, dtype, dummy=dummy, seed=seed)
            engines[TALKER] = talker_engine(talker, ckpt.config(), num_pages=kv.max_num_pages,
                                            page_size=kv.page_size, max_seq_len=self.config.max_seq_len,
                                            device=device, dtype=dtype,
                                            # input slots (12 KiB each at 1.7B): room to spare
                                            max_requests=4 * self.config.max_concurrent_requests,
                                            cuda_graphs=self.knobs.cuda_graphs,
                                            overlap_scheduling=self.knobs.overlap_scheduling,
                                            fused_kernels=self.knobs.fused_kernels)
        if CODEC in nodes:  # float32 by default: the reference decoder's numerics
            codec = ckpt.codec(device, getattr(torch, self.knobs.codec_dtype), dummy=dummy, seed=seed + 1)
            marks = self.knobs.audio_watermark
            engines[CODEC] = CodecEngine(codec, marks.build(device, dummy=dummy, seed=seed + 3), marks,
                                         left_context=self.knobs.codec_left_context,
                                         cuda_graphs=self.knobs.codec_cuda_graphs,
                                         max_frames=self.knobs.codec_chunk_frames)
        return engines


@register
class Qwen3TTSCustomVoice(Qwen3TTS):
    key = "qwen3_tts"
    default_weights = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"


@register
class Qwen3TTSCustomVoice1p7b(Qwen3TTS):
    key = "qwen3_tts_1p7b"
    default_weights = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"


@register
class Qwen3TTSVoiceDesign(Qwen3TTS):
    key = "qwen3_tts_voicedesign"
    default_weights = "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign"


@register
class Qwen3TTSBase(Qwen3TTS, VoiceCloning):
    key = "qwen3_tts_base"
    default_weights = "Qwen/Qwen3-TTS-12Hz-1.7B-Base"
    Knobs = Qwen3TTSBaseKnobs
    knobs: Qwen3TTSBaseKnobs
    conditions_on_text = False  # the x-vector and the codes are the audio's alone
    conditioning_version = 2  # a clip's codes beside its x-vector

    def load_frontend(self) -> None:
        super().load_frontend()
        self.presets = VoicePresets(self.knobs.voices_dir) if self.knobs.voices_dir else None

    def voices(self) -> list[str]:
        presets = getattr(self, "presets", None)
        return presets.names if presets is not None else []

    def voice_list(self) -> list[Voice]:
        presets = getattr(self, "presets", None)
        return presets.voices() if presets is not None else []

    def condition_on_clip(self, samples: np.ndarray, sample_rate: int, ref_text: str | None) -> ClipConditioning:
        """The clip's x-vector ``[hidden]`` (the speaker encoder) and its 12 Hz codes ``[T, Q]``
        (the codec's encoder), both from the clip at 24 kHz; the transcript is not read."""
        if len(samples) < sample_rate // 10:
            raise RequestError("ref_audio", "is shorter than 0.1 s")
        clip = resample(samples, sample_rate, SAMPLE_RATE)
        embed = self.speaker_encoder.embed_clip(clip)
        if embed.shape[-1] != self.tts.talker.text.hidden_size:
            raise ValueError(f"speaker_encoder_config.enc_dim {embed.shape[-1]} != the talker's hidden_size "
                             f"{self.tts.talker.text.hidden_size}")
        codes = self.codec_encoder.encode(torch.as_tensor(np.ascontiguousarray(clip), dtype=torch.float32))
        return ClipConditioning(embed.clone(), codes)
