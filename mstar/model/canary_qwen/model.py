"""Canary-Qwen 2.5B English speech recognition: the declaration.

Two nodes on the graph Canary and Whisper share (``transcribe_graph``): the speech side
(``encoder``: FastConformer, modality adapter, projection; stateless, batched across clips)
and the LLM (``decoder``: Qwen3-1.7B with LoRA merged, paged KV). The ``transcribe`` walk
encodes the clip, prefills the LLM on the chat prompt with the audio embeddings in place of
the locator tag, then decodes until ``<|im_end|>``. Uploads longer than ``max_clip_seconds``
(40.96 s) are cut into windows at quiet points (``mstar.model.windowed``), each its own walk.

The prompt is NeMo's ``qwen`` format of one user turn, ``<|im_start|>user\\n{instruction}
{tag}<|im_end|>\\n<|im_start|>assistant\\n``, the instruction ``Transcribe the following:``
unless the request's ``instruction`` replaces it. English only: a ``language`` other than en
is refused. The OpenAI ``prompt`` is ignored, and so is ``/generate``'s ``text``.
"""

from __future__ import annotations

import torch

from mstar.config import ConfigError
from mstar.contract import GenerateSpec, RequestError, Transcription, TranscriptionSpec
from mstar.graph import Graph
from mstar.model.canary_qwen.checkpoint import CanaryQwenCheckpoint
from mstar.model.canary_qwen.engine import canary_qwen_engines
from mstar.model.canary_qwen.knobs import TRAINED_INSTRUCTION, CanaryQwenKnobs, CanaryQwenRequestKnobs
from mstar.model.decoding import decode_request, pool_for_every_request, transcribe_graph
from mstar.model.fastconformer.features import log_mel
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.text_stream import TokenTextStream
from mstar.model.windowed import RunWalk, options_transcription, transcribe_windows

ENGLISH = frozenset({"en", "english"})


@register
class CanaryQwen(ModelSpec):
    key = "canary_qwen"
    default_weights = "nvidia/canary-qwen-2.5b"
    tasks = frozenset({"transcription"})
    Knobs = CanaryQwenKnobs
    knobs: CanaryQwenKnobs

    def graph(self) -> Graph:
        return transcribe_graph()

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> CanaryQwenCheckpoint:
        path = self.config.model_path or self.default_weights
        if path is None:
            raise ValueError(f"model {self.key!r} needs model_path")
        return CanaryQwenCheckpoint.locate(path, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.model_config = ckpt.config()
        self.mel = self.model_config.mel
        self.tokenizer, eos = ckpt.tokenizer(self.model_config)
        self.locator_id = self.tokenizer.token_to_id(self.model_config.audio_locator_tag)
        if self.locator_id >= self.model_config.llm.vocab_size:
            raise ValueError(f"the audio locator tag's id {self.locator_id} is outside the LLM's vocabulary "
                             f"({self.model_config.llm.vocab_size})")
        self.stop_ids = [i for i in (self.tokenizer.token_to_id(eos), self.tokenizer.token_to_id("<|endoftext|>"))
                         if i is not None]
        if not self.stop_ids:
            raise ValueError(f"the LLM's tokenizer has no {eos} token")
        longest = len(self.prompt_ids(TRAINED_INSTRUCTION, self.audio_positions(self.knobs.max_clip_seconds)))
        if longest >= self.config.max_seq_len:
            raise ConfigError(f"max_seq_len ({self.config.max_seq_len}) cannot hold the prompt of a "
                              f"{self.knobs.max_clip_seconds} s clip ({longest} positions) and a token: raise it "
                              "or lower model_kwargs.max_clip_seconds")

    def audio_positions(self, seconds: float) -> int:
        """Audio embeddings of a clip of ``seconds``."""
        return self.model_config.frames(self.mel.frames(int(round(seconds * self.mel.sample_rate))))

    def prompt_ids(self, instruction: str, audio_positions: int) -> list[int]:
        """The chat prompt with one locator token per audio embedding."""
        tag = self.model_config.audio_locator_tag

        def ids(text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False).ids

        user = ids(f"<|im_start|>user\n{instruction} {tag}<|im_end|>\n")
        at = user.index(self.locator_id)
        return user[:at] + [self.locator_id] * audio_positions + user[at + 1:] + ids("<|im_start|>assistant\n")

    def default_capacity(self) -> dict[str, int]:
        """The KV pool, refused at startup unless every admitted request can hold ``max_seq_len``
        positions (its prompt, audio included, and its tokens) at once."""
        return pool_for_every_request(self.config, self.config.max_seq_len, f"max_seq_len {self.config.max_seq_len}")

    def output_stream(self, request: WalkRequest, stop: list[str]) -> TokenTextStream:
        return TokenTextStream(self.tokenizer)

    def clip_request(self, samples: torch.Tensor, instruction: str) -> WalkRequest:
        mel = log_mel(samples, self.mel)
        prompt = self.prompt_ids(instruction, self.model_config.frames(mel.shape[0]))
        budget = min(self.knobs.max_new_tokens, self.config.max_seq_len - len(prompt))
        if budget < 1:
            raise RequestError("instruction", f"the prompt takes {len(prompt)} of max_seq_len "
                                              f"({self.config.max_seq_len}) positions: shorten the instruction")
        return decode_request("transcribe", {"mel": mel, "prompt_ids": torch.tensor(prompt, dtype=torch.int64)},
                              len(prompt), budget, {"temperature": 0.0}, self.stop_ids, self.config, upfront=True)

    def instruction(self, spec: TranscriptionSpec) -> str:
        """The request's instruction, its language checked (English only)."""
        extra = CanaryQwenRequestKnobs.parse(spec.model_kwargs)
        language = spec.language or extra.language
        if language is not None and language.strip().lower() not in ENGLISH:
            raise RequestError("language", f"Canary-Qwen transcribes English only (en); got {language!r}")
        if spec.task != "transcribe":
            raise RequestError("task", f"model {self.key!r} transcribes; it does not translate")
        if spec.temperature:
            raise RequestError("temperature", f"model {self.key!r} decodes greedily: send 0 or leave it out")
        return (extra.instruction or TRAINED_INSTRUCTION).strip()

    def transcription_of(self, spec: GenerateSpec) -> TranscriptionSpec:
        """``/generate`` with one audio file: its ``model_kwargs`` are the options, its text unused."""
        return options_transcription(spec, self.key, CanaryQwenRequestKnobs)

    async def transcribe(self, spec: TranscriptionSpec, run: RunWalk) -> Transcription:
        instruction = self.instruction(spec)
        return await transcribe_windows(
            spec.audio, run, lambda samples: self.clip_request(samples, instruction), sample_rate=self.mel.sample_rate,
            max_bytes=self.knobs.max_upload_bytes, max_seconds=self.knobs.max_audio_seconds,
            max_window_s=self.knobs.max_clip_seconds, min_samples=self.mel.hop_length, language="en",
            parallel=self.config.max_concurrent_requests)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        ckpt = self.checkpoint()
        dtype = self.config.torch_dtype()
        model = ckpt.load_model(device, dtype, dummy=self.config.load_format == "dummy", seed=self.knobs.seed)
        tokenizer, _ = ckpt.tokenizer(model.config)
        kv = self.config.resources.kv_cache
        return canary_qwen_engines(model, nodes, locator_id=tokenizer.token_to_id(model.config.audio_locator_tag),
                                   num_pages=kv.max_num_pages, page_size=kv.page_size,
                                   max_seq_len=self.config.max_seq_len, device=device, dtype=dtype,
                                   attention_backend=self.knobs.attention_backend,
                                   fused_kernels=self.knobs.fused_kernels)


__all__ = ["CanaryQwen"]
