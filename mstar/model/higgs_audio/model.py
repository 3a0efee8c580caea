"""Higgs Audio v3 STT (Beta): the declaration.

Two nodes on the graph the transcription families share (``transcribe_graph``): the speech
side (``encoder``: the Whisper tower and the projector; stateless, batched across clips) and
the LLM (``decoder``: Qwen3 on paged KV). The ``transcribe`` walk encodes the clip in 4 s
slices, prefills the LLM on the chat prompt with the slices' embeddings, concatenated, in
place of its ``<|AUDIO|>`` tokens, then decodes greedily until ``<|im_end|>`` or
``<|endoftext|>``. Uploads longer than ``max_clip_seconds`` (30 s) are cut into windows at
quiet points (``mstar.model.windowed``), each its own walk.

The prompt (as public code lays it out; the release's own processor was not reachable):
``<|im_start|>user\\n{instruction} <|audio_bos|>`` + one ``<|AUDIO|>`` per embedding +
``<|audio_eos|>\\n<|im_end|>\\n<|im_start|>assistant\\n``, the instruction the default one
unless the request's ``instruction`` replaces it. ``language`` is accepted and not used (the
model finds the language itself), the OpenAI ``prompt`` is ignored, and so is ``/generate``'s
``text``.
"""

from __future__ import annotations

import torch

from mstar.config import ConfigError
from mstar.contract import GenerateSpec, RequestError, Transcription, TranscriptionSpec
from mstar.graph import Graph
from mstar.model.decoding import decode_request, pool_for_every_request, transcribe_graph
from mstar.model.higgs_audio.checkpoint import HiggsAudioCheckpoint
from mstar.model.higgs_audio.engine import higgs_audio_engines
from mstar.model.higgs_audio.knobs import DEFAULT_INSTRUCTION, HiggsAudioKnobs, HiggsAudioRequestKnobs
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.text_stream import TokenTextStream
from mstar.model.whisper.features import HOP_LENGTH, SAMPLE_RATE, log_mel_spectrogram
from mstar.model.windowed import RunWalk, options_transcription, transcribe_windows

MIN_FRAMES = 3  # the shortest slice that gives an audio embedding


@register
class HiggsAudio(ModelSpec):
    key = "higgs_audio"
    default_weights = "bosonai/higgs-audio-v3-stt"
    tasks = frozenset({"transcription"})
    Knobs = HiggsAudioKnobs
    knobs: HiggsAudioKnobs

    def graph(self) -> Graph:
        return transcribe_graph()

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> HiggsAudioCheckpoint:
        path = self.config.model_path or self.default_weights
        return HiggsAudioCheckpoint.locate(path, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.model_config = ckpt.config()
        self.tokenizer = ckpt.tokenizer()
        vocab = self.model_config.llm.vocab_size
        for name in ("audio_in_token_id", "audio_bos_token_id", "audio_eos_token_id"):
            if not 0 <= getattr(self.model_config, name) < vocab:
                raise ValueError(f"config.json: {name} {getattr(self.model_config, name)} is outside the LLM's "
                                 f"vocabulary ({vocab})")
        self.stop_ids = [i for i in (self.tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
                         if i is not None]
        if not self.stop_ids:
            raise ValueError("the tokenizer has neither <|im_end|> nor <|endoftext|>")
        longest = len(self.prompt_ids(DEFAULT_INSTRUCTION, self.audio_positions(self.knobs.max_clip_seconds)))
        if longest >= self.config.max_seq_len:
            raise ConfigError(f"max_seq_len ({self.config.max_seq_len}) cannot hold the prompt of a "
                              f"{self.knobs.max_clip_seconds} s clip ({longest} positions) and a token: raise it "
                              "or lower model_kwargs.max_clip_seconds")

    def slice_frames(self, num_samples: int) -> list[int]:
        """Mel frames of each slice of a clip of ``num_samples`` (a last slice too short to give
        an embedding is dropped)."""
        step = self.model_config.chunk_samples
        frames = [min(step, num_samples - start) // HOP_LENGTH for start in range(0, num_samples, step)]
        return [f for f in frames if f >= MIN_FRAMES]

    def audio_positions(self, seconds: float) -> int:
        """Audio embeddings of a clip of ``seconds``."""
        frames = self.slice_frames(int(round(seconds * SAMPLE_RATE)))
        return sum(self.model_config.positions(f) for f in frames)

    def prompt_ids(self, instruction: str, audio_positions: int) -> list[int]:
        """The chat prompt with one ``<|AUDIO|>`` per audio embedding."""
        c = self.model_config

        def ids(text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False).ids

        return (ids(f"<|im_start|>user\n{instruction} ") + [c.audio_bos_token_id]
                + [c.audio_in_token_id] * audio_positions + [c.audio_eos_token_id]
                + ids("\n<|im_end|>\n<|im_start|>assistant\n"))

    def default_capacity(self) -> dict[str, int]:
        """The KV pool, refused at startup unless every admitted request can hold ``max_seq_len``
        positions (its prompt, audio included, and its tokens) at once."""
        return pool_for_every_request(self.config, self.config.max_seq_len, f"max_seq_len {self.config.max_seq_len}")

    def output_stream(self, request: WalkRequest, stop: list[str]) -> TokenTextStream:
        return TokenTextStream(self.tokenizer)

    def clip_request(self, samples: torch.Tensor, instruction: str) -> WalkRequest:
        """The walk of one window: its slices' log-mels side by side, and the prompt."""
        frames = self.slice_frames(samples.shape[0])
        step, n_mels = self.model_config.chunk_samples, self.model_config.tower.num_mel_bins
        mels = [log_mel_spectrogram(samples[i * step:i * step + f * HOP_LENGTH], n_mels, n_samples=f * HOP_LENGTH)
                for i, f in enumerate(frames)]
        prompt = self.prompt_ids(instruction, sum(self.model_config.positions(f) for f in frames))
        budget = min(self.knobs.max_new_tokens, self.config.max_seq_len - len(prompt))
        if budget < 1:
            raise RequestError("instruction", f"the prompt takes {len(prompt)} of max_seq_len "
                                              f"({self.config.max_seq_len}) positions: shorten the instruction")
        inputs = {"mel": torch.cat(mels, dim=-1), "prompt_ids": torch.tensor(prompt, dtype=torch.int64)}
        return decode_request("transcribe", inputs, len(prompt), budget, {"temperature": 0.0}, self.stop_ids,
                              self.config, upfront=True, slice_frames=frames)

    def instruction(self, spec: TranscriptionSpec) -> str:
        """The request's instruction, its other fields checked."""
        extra = HiggsAudioRequestKnobs.parse(spec.model_kwargs)
        if spec.task != "transcribe":
            raise RequestError("task", f"model {self.key!r} transcribes; it does not translate")
        if spec.temperature:
            raise RequestError("temperature", f"model {self.key!r} decodes greedily: send 0 or leave it out")
        return (extra.instruction or DEFAULT_INSTRUCTION).strip()

    def transcription_of(self, spec: GenerateSpec) -> TranscriptionSpec:
        """``/generate`` with one audio file: its ``model_kwargs`` are the options, its text unused."""
        return options_transcription(spec, self.key, HiggsAudioRequestKnobs)

    async def transcribe(self, spec: TranscriptionSpec, run: RunWalk) -> Transcription:
        instruction = self.instruction(spec)
        return await transcribe_windows(
            spec.audio, run, lambda samples: self.clip_request(samples, instruction), sample_rate=SAMPLE_RATE,
            max_bytes=self.knobs.max_upload_bytes, max_seconds=self.knobs.max_audio_seconds,
            max_window_s=self.knobs.max_clip_seconds, min_samples=MIN_FRAMES * HOP_LENGTH,
            language=(spec.language or "").strip().lower(), parallel=self.config.max_concurrent_requests)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        dtype = self.config.torch_dtype()
        model = self.checkpoint().load_model(device, dtype, dummy=self.config.load_format == "dummy",
                                             seed=self.knobs.seed)
        kv = self.config.resources.kv_cache
        return higgs_audio_engines(model, nodes, num_pages=kv.max_num_pages, page_size=kv.page_size,
                                   max_seq_len=self.config.max_seq_len, device=device, dtype=dtype,
                                   attention_backend=self.knobs.attention_backend,
                                   fused_kernels=self.knobs.fused_kernels)


__all__ = ["HiggsAudio"]
