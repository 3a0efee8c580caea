"""Qwen3-ASR speech recognition: the declaration.

Two nodes on the graph Whisper and Canary share (``transcribe_graph``): the audio side
(``encoder``: AuT and its projector; stateless, batched across clips) and the LLM
(``decoder``: a dense Qwen3 decoder, paged KV). The ``transcribe`` walk encodes the clip,
prefills the LLM on the chat prompt with the audio rows over its ``<|audio_pad|>`` tokens,
then decodes until ``<|im_end|>``.

The prompt is the reference SDK's: a system turn holding the context (the request's
``context``, else the OpenAI ``prompt``, else empty), a user turn holding only the audio
(``<|audio_start|>``, one ``<|audio_pad|>`` per audio row, ``<|audio_end|>``), then the
assistant turn. The model names the language it hears before the transcript
(``language English<asr_text>...``); a forced ``language`` is written there in the prompt
instead. A whole upload of up to ``max_audio_seconds`` (20 minutes) is one prompt, as the
SDK's longest single pass; a longer one is refused naming the limit. The transcript's
repetition loops are collapsed as the SDK does (``text.py``).

``qwen3_asr_realtime`` is the 0.6B checkpoint on the same class, served as well through
``/v1/realtime`` transcription sessions.
"""

from __future__ import annotations

import asyncio

import torch

from mstar.audio import decode_audio
from mstar.config import ConfigError
from mstar.contract import GenerateSpec, RequestError, Transcription, TranscriptionSegment, TranscriptionSpec
from mstar.graph import Graph
from mstar.model.decoding import decode_request, pool_for_every_request, transcribe_graph
from mstar.model.qwen3_asr.checkpoint import Qwen3ASRCheckpoint
from mstar.model.qwen3_asr.engine import qwen3_asr_engines
from mstar.model.qwen3_asr.knobs import Qwen3ASRKnobs, Qwen3ASRRequestKnobs
from mstar.model.qwen3_asr.text import language_code, language_name, parse_output
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.text_stream import TokenTextStream
from mstar.model.whisper.features import log_mel_spectrogram
from mstar.model.windowed import RunWalk, options_transcription

SAMPLE_RATE = 16000
HOP = 160
MIN_SAMPLES = SAMPLE_RATE // 2  # shorter clips are zero-padded to 0.5 s, as the reference does


class TranscriptStream(TokenTextStream):
    """The raw text, ``<asr_text>`` kept whether or not the tokenizer calls it special (the
    language parse needs it); only the stop tokens are left out."""

    def __init__(self, tokenizer, stop_ids: list[int]) -> None:
        super().__init__(tokenizer)
        self.stop_ids = frozenset(stop_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=False)


@register
class Qwen3ASR(ModelSpec):
    key = "qwen3_asr"
    default_weights = "Qwen/Qwen3-ASR-1.7B"
    tasks = frozenset({"transcription"})
    Knobs = Qwen3ASRKnobs
    knobs: Qwen3ASRKnobs

    def graph(self) -> Graph:
        return transcribe_graph()

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> Qwen3ASRCheckpoint:
        path = self.config.model_path or self.default_weights
        return Qwen3ASRCheckpoint.locate(path, self.config.cache_dir, dummy=self.config.load_format == "dummy")

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.model_config = ckpt.config()
        self.tokenizer = ckpt.tokenizer()
        vocab = self.tokenizer.get_vocab()
        missing = [t for t in ("<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>") if t not in vocab]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)} token(s)")
        self.stop_ids = [vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab]
        longest = len(self.prompt_ids(self.positions(int(self.knobs.max_audio_seconds * SAMPLE_RATE)), "", None))
        if longest >= self.config.max_seq_len:
            raise ConfigError(f"max_seq_len ({self.config.max_seq_len}) cannot hold the prompt of a "
                              f"{self.knobs.max_audio_seconds:g} s clip ({longest} positions) and a token: raise it "
                              "or lower model_kwargs.max_audio_seconds")

    def positions(self, samples: int) -> int:
        """Audio rows (LLM positions) of a clip of ``samples`` at 16 kHz."""
        return self.model_config.audio.positions(max(samples, MIN_SAMPLES) // HOP)

    def prompt_ids(self, audio_rows: int, context: str, language: str | None) -> list[int]:
        """The chat prompt with one ``<|audio_pad|>`` per audio row (and the forced language)."""

        def ids(text: str) -> list[int]:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

        head = ids(f"<|im_start|>system\n{context}<|im_end|>\n<|im_start|>user\n<|audio_start|>")
        tail = ids("<|audio_end|><|im_end|>\n<|im_start|>assistant\n"
                   + (f"language {language}<asr_text>" if language else ""))
        return head + [self.model_config.audio_token_id] * audio_rows + tail

    def default_capacity(self) -> dict[str, int]:
        """The KV pool, refused at startup unless every admitted request can hold ``max_seq_len``
        positions (its prompt, audio included, and its tokens) at once."""
        return pool_for_every_request(self.config, self.config.max_seq_len, f"max_seq_len {self.config.max_seq_len}")

    def output_stream(self, request: WalkRequest, stop: list[str]) -> TokenTextStream:
        return TranscriptStream(self.tokenizer, self.stop_ids)

    def mel(self, samples: torch.Tensor) -> torch.Tensor:
        """Log-mels ``[T, mel]`` of a 16 kHz clip (zero-padded to 0.5 s)."""
        samples = torch.nn.functional.pad(samples, (0, max(0, MIN_SAMPLES - samples.shape[0])))
        return log_mel_spectrogram(samples, self.model_config.audio.num_mel_bins, n_samples=samples.shape[0]).T

    def clip_request(self, samples: torch.Tensor, context: str, language: str | None) -> WalkRequest:
        mel = self.mel(samples)
        prompt = self.prompt_ids(self.model_config.audio.positions(mel.shape[0]), context, language)
        budget = min(self.knobs.max_new_tokens, self.config.max_seq_len - len(prompt))
        if budget < 1:
            raise RequestError("prompt", f"the prompt takes {len(prompt)} of max_seq_len "
                                         f"({self.config.max_seq_len}) positions: shorten the context")
        return decode_request("transcribe", {"mel": mel, "prompt_ids": torch.tensor(prompt, dtype=torch.int64)},
                              len(prompt), budget, {"temperature": 0.0}, self.stop_ids, self.config, upfront=True)

    def options(self, spec: TranscriptionSpec) -> tuple[str, str | None]:
        """The request's context and forced language name (None: detect)."""
        extra = Qwen3ASRRequestKnobs.parse(spec.model_kwargs)
        if spec.task != "transcribe":
            raise RequestError("task", f"model {self.key!r} transcribes; it does not translate")
        if spec.temperature:
            raise RequestError("temperature", f"model {self.key!r} decodes greedily: send 0 or leave it out")
        language = spec.language or extra.language
        context = extra.context if extra.context is not None else (spec.prompt or "")
        return context.strip(), language_name(language) if language else None

    def transcription_of(self, spec: GenerateSpec) -> TranscriptionSpec:
        """``/generate`` with one audio file: its ``model_kwargs`` are the options, its text unused."""
        return options_transcription(spec, self.key, Qwen3ASRRequestKnobs)

    async def transcribe(self, spec: TranscriptionSpec, run: RunWalk) -> Transcription:
        context, forced = self.options(spec)
        decoded = await asyncio.to_thread(decode_audio, spec.audio, max_bytes=self.knobs.max_upload_bytes,
                                          max_seconds=self.knobs.max_audio_seconds, target_rate=SAMPLE_RATE)
        if decoded.samples.shape[0] == 0:
            raise RequestError("file", "the audio is empty")
        samples = torch.from_numpy(decoded.samples)
        out = await run(await asyncio.to_thread(self.clip_request, samples, context, forced))
        name, text = parse_output(out.text, forced, self.knobs.repetition_threshold)
        segment = TranscriptionSegment(id=0, start=0.0, end=decoded.duration, text=text, tokens=out.token_ids)
        return Transcription(text=text, language=language_code(name), duration=decoded.duration, segments=[segment])

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        dtype = self.config.torch_dtype()
        model = self.checkpoint().load_model(device, dtype, dummy=self.config.load_format == "dummy",
                                             seed=self.knobs.seed)
        kv = self.config.resources.kv_cache
        return qwen3_asr_engines(model, nodes, num_pages=kv.max_num_pages, page_size=kv.page_size,
                                 max_seq_len=self.config.max_seq_len, device=device, dtype=dtype,
                                 attention_backend=self.knobs.attention_backend,
                                 fused_kernels=self.knobs.fused_kernels, cuda_graphs=self.knobs.cuda_graphs,
                                 overlap_scheduling=self.knobs.overlap_scheduling)


@register
class Qwen3ASRRealtime(Qwen3ASR):
    """The 0.6B checkpoint, also on ``/v1/realtime`` as transcription sessions: each committed
    turn (by hand, or by server VAD) is transcribed and sent as a delta, then completed."""

    key = "qwen3_asr_realtime"
    default_weights = "Qwen/Qwen3-ASR-0.6B"
    tasks = frozenset({"transcription", "realtime"})


__all__ = ["Qwen3ASR", "Qwen3ASRRealtime"]
