"""FastConformer transducers (Parakeet TDT, Nemotron ASR): the declaration.

Two nodes: the encoder (stateless, batched across clips) and the greedy decoder (each clip's
state in a recurrent-state slot, ``engine.py``). The ``transcribe`` walk is the encoder, then a
Loop of decode iterations, each a bounded number of greedy steps whose tokens stream out as it
ends, until the clip's frames are spent. An upload longer than ``max_clip_seconds`` is cut into
windows at quiet points (``mstar.model.windowed`` over ``mstar.audio.windows``, as Whisper's
are), each window its own walk; their texts are joined.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from mstar.config import ConfigError
from mstar.contract import (
    GenerateSpec,
    RequestError,
    Transcription,
    TranscriptionSpec,
)
from mstar.engine.cuda_graphs import buckets_up_to
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.decoding import state_capacity, state_slots
from mstar.model.fastconformer.checkpoint import TransducerCheckpoint
from mstar.model.fastconformer.engine import transducer_engines
from mstar.model.fastconformer.features import log_mel
from mstar.model.fastconformer.knobs import NemotronAsrKnobs, TransducerKnobs, TransducerRequestKnobs
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.text_stream import TokenTextStream
from mstar.model.windowed import RunWalk, generate_audio_file, transcribe_windows

SAMPLE_RATE = 16000
TRANSDUCER_SLOTS = "transducer_slots"
# The 25 European languages Parakeet TDT v3 recognises (it detects which from the speech).
PARAKEET_LANGUAGES = frozenset("bg hr cs da nl en et fi fr de el hu it lv lt mt pl pt ro sk sl es sv ru uk".split())



class Transducer(ModelSpec):
    """The shared declaration; a key says how a request's ``language`` is taken."""

    tasks = frozenset({"transcription"})
    Knobs: ClassVar[type[TransducerKnobs]] = TransducerKnobs
    knobs: TransducerKnobs
    prompted: ClassVar[bool] = False  # the encoder reads a language prompt

    def graph(self) -> Graph:
        reads = ("mel", "prompt") if self.prompted else ("mel",)
        encoder = Node("encoder", "stateless", inputs=reads, outputs=("audio_features",))
        decoder = Node("decoder", "stream", inputs=("audio_features",), outputs=("tokens",), ops=("decode",),
                       flags=("stop",))
        walk = Walk("transcribe", Sequential(
            Step("encoder", reads=reads, writes="audio_features"),
            Loop(Step("decoder", "decode", reads="audio_features", writes="tokens", emit=Emit("tokens", "text")),
                 until="stop", max_iters="max_decode_iters"),
        ), inputs=reads)
        return Graph.build([encoder, decoder], [walk])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> TransducerCheckpoint:
        path = self.config.model_path or self.default_weights
        if path is None:
            raise ValueError(f"model {self.key!r} needs model_path")
        return TransducerCheckpoint.locate(path, self.config.cache_dir)

    @property
    def max_slots(self) -> int:
        return state_slots(self.config, "transducer_state")

    def default_capacity(self) -> dict[str, int]:
        return {TRANSDUCER_SLOTS: state_capacity(self.config, "transducer_state")}

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.model_config = ckpt.config()
        self.mel = ckpt.mel_settings(self.model_config)
        self.tokenizer = ckpt.tokenizer()

    def output_stream(self, request: WalkRequest, stop: list[str]) -> TokenTextStream:
        return TokenTextStream(self.tokenizer)

    def language_prompt(self, language: str | None) -> int | None:
        """The encoder's prompt for ``language`` (None: the model reads none); a
        ``RequestError`` naming ``language`` for one the model does not take."""
        return None

    def clip_request(self, samples: torch.Tensor, prompt: int | None) -> WalkRequest:
        """The walk of one window: its log-mel, its prompt; admitted against one state slot."""
        mel = log_mel(samples, self.mel)
        inputs = {"mel": mel}
        if self.prompted:
            inputs["prompt"] = torch.tensor([prompt], dtype=torch.int64)
        steps = self.model_config.encoder.frames(mel.shape[0]) * self.model_config.max_symbols_per_step
        iterations = math.ceil(steps / self.knobs.steps_per_iteration) + 1
        return WalkRequest("transcribe", inputs, {"max_decode_iters": iterations}, {TRANSDUCER_SLOTS: 1})

    def transcription_of(self, spec: GenerateSpec) -> TranscriptionSpec:
        """The transcription ``/generate`` asks for: its one file is the audio, its
        ``model_kwargs`` the options (``TransducerRequestKnobs``); its text is not read."""
        filename, data = generate_audio_file(spec, self.key)
        options = TransducerRequestKnobs.parse(spec.model_kwargs)
        return TranscriptionSpec(spec.request_id, data, filename, language=options.language)

    async def transcribe(self, spec: TranscriptionSpec, run: RunWalk) -> Transcription:
        language = spec.language or TransducerRequestKnobs.parse(spec.model_kwargs).language
        prompt = self.language_prompt(language)
        if spec.temperature:
            raise RequestError("temperature", f"model {self.key!r} decodes greedily: send 0 or leave it out")
        return await transcribe_windows(
            spec.audio, run, lambda samples: self.clip_request(samples, prompt), sample_rate=SAMPLE_RATE,
            max_bytes=self.knobs.max_upload_bytes, max_seconds=self.knobs.max_audio_seconds,
            max_window_s=self.knobs.max_clip_seconds, min_samples=self.mel.hop_length, language=language or "",
            parallel=self.config.max_concurrent_requests)

    # ---------------------------------------------------------------- worker
    def lookahead(self) -> int | None:
        return None

    def build_engines(self, nodes: set[str], device: torch.device):
        ckpt = self.checkpoint()
        model = ckpt.load_model(device, self.config.torch_dtype(), dummy=self.config.load_format == "dummy",
                                seed=self.knobs.seed)
        buckets = None
        if self.knobs.cuda_graphs:  # a bucket for every batch the slots allow
            buckets = buckets_up_to(self.max_slots)
        return transducer_engines(model, nodes, max_slots=self.max_slots,
                                  steps_per_iteration=self.knobs.steps_per_iteration, lookahead=self.lookahead(),
                                  device=device, dtype=self.config.torch_dtype(), device_loop=self.knobs.device_loop,
                                  graph_batch_sizes=buckets)


@register
class Parakeet(Transducer):
    """Parakeet TDT v3: 25 European languages, detected from the speech. ``language`` may name
    one of them (and is then not needed); any other is refused."""

    key = "parakeet"
    default_weights = "nvidia/parakeet-tdt-0.6b-v3"

    def language_prompt(self, language: str | None) -> int | None:
        if language is not None and language.lower() not in PARAKEET_LANGUAGES:
            raise RequestError("language", f"model {self.key!r} does not recognise {language!r}; it takes "
                                           f"{', '.join(sorted(PARAKEET_LANGUAGES))} (and detects which)")
        return None


@register
class NemotronAsr(Transducer):
    """Nemotron 3.5 ASR streaming, served over whole clips at its widest lookahead
    (``model_kwargs.lookahead``). ``language`` is its prompt: a locale of the checkpoint's
    prompt dictionary (``en-US``), a bare code (``de``) or ``auto`` (the default)."""

    key = "nemotron_asr"
    default_weights = "nvidia/nemotron-3.5-asr-streaming-0.6b"
    Knobs = NemotronAsrKnobs
    knobs: NemotronAsrKnobs
    prompted = True

    def load_frontend(self) -> None:
        super().load_frontend()
        self.prompts = self.checkpoint().prompts()
        self.lookahead()

    def lookahead(self) -> int:
        """``model_kwargs.lookahead``, checked against the checkpoint's; default the widest."""
        supported = self.checkpoint().lookaheads()
        if self.knobs.lookahead is None:
            return supported[0]
        if self.knobs.lookahead not in supported:
            raise ConfigError(f"model_kwargs.lookahead: must be one the checkpoint was trained with "
                              f"({', '.join(map(str, supported))}), got {self.knobs.lookahead}")
        return self.knobs.lookahead

    def language_prompt(self, language: str | None) -> int:
        name = (language or "auto").strip().lower()
        if name not in self.prompts:
            raise RequestError("language", f"model {self.key!r} takes a locale such as en-US, a bare code such "
                                           f"as de, or auto; got {language!r}")
        return self.prompts[name]


__all__ = ["NemotronAsr", "Parakeet", "Transducer"]
