"""Canary 1B v2 speech recognition and translation: the declaration.

Two nodes: the FastConformer encoder (stateless, batched across clips) and the Transformer
decoder (autoregressive, paged self-attention KV, cross-attention K/V kept per request). The
``transcribe`` walk is the encoder, the decoder's prefill of the multitask prompt, then a Loop
of decodes until ``<|endoftext|>``. Uploads longer than ``max_clip_seconds`` (40.96 s) are cut
into windows at quiet points (``mstar.model.windowed``), each its own walk.

Request fields: ``language`` (the speech's, default en; one of the 25), ``target_language``
(a translation to or from English; /v1/audio/translations translates to English) and
``punctuation`` (default on), on the OpenAI routes as form fields or in ``model_kwargs``.
"""

from __future__ import annotations

import torch

from mstar.contract import GenerateSpec, RequestError, Transcription, TranscriptionSpec
from mstar.graph import Graph
from mstar.model.canary.checkpoint import CanaryCheckpoint
from mstar.model.canary.engine import canary_engines
from mstar.model.canary.knobs import CanaryKnobs, CanaryRequestKnobs
from mstar.model.canary.prompt import LANGUAGES, CanaryPrompt
from mstar.model.decoding import decode_request, pool_for_every_request, transcribe_graph
from mstar.model.fastconformer.features import log_mel
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.text_stream import TokenTextStream
from mstar.model.windowed import RunWalk, options_transcription, transcribe_windows

SAMPLE_RATE = 16000
PROMPT_TOKENS = 9  # the multitask prompt (prompt.py)


def _language(value: str | None, field: str, default: str) -> str:
    code = (value or default).strip().lower()
    if code not in LANGUAGES:
        raise RequestError(field, f"Canary takes one of {', '.join(sorted(LANGUAGES))}; got {value!r}")
    return code


@register
class Canary(ModelSpec):
    key = "canary"
    default_weights = "nvidia/canary-1b-v2"
    tasks = frozenset({"transcription", "translation"})
    Knobs = CanaryKnobs
    knobs: CanaryKnobs

    def graph(self) -> Graph:
        return transcribe_graph()

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> CanaryCheckpoint:
        path = self.config.model_path or self.default_weights
        if path is None:
            raise ValueError(f"model {self.key!r} needs model_path")
        return CanaryCheckpoint.locate(path, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.model_config = ckpt.config()
        self.mel = ckpt.mel_settings(self.model_config)
        self.tokenizer = ckpt.tokenizer()
        self.prompt = CanaryPrompt(self.tokenizer)

    def default_capacity(self) -> dict[str, int]:
        """The KV pool, refused at startup unless every admitted request can hold its longest
        window's pages (the prompt and ``max_new_tokens``) at once."""
        return pool_for_every_request(self.config, PROMPT_TOKENS + self.knobs.max_new_tokens,
                                      "the prompt and model_kwargs.max_new_tokens")

    def output_stream(self, request: WalkRequest, stop: list[str]) -> TokenTextStream:
        return TokenTextStream(self.tokenizer)

    def clip_request(self, samples: torch.Tensor, prompt: list[int]) -> WalkRequest:
        mel = log_mel(samples, self.mel)
        budget = min(self.knobs.max_new_tokens, self.model_config.decoder.max_position_embeddings - len(prompt))
        return decode_request("transcribe", {"mel": mel, "prompt_ids": torch.tensor(prompt, dtype=torch.int64)},
                              len(prompt), budget, {"temperature": 0.0}, [self.prompt.eos], self.config)

    def options(self, spec: TranscriptionSpec) -> tuple[str, str, bool]:
        """``(source, target, punctuation)`` of a request: its form fields over its
        ``model_kwargs``; a translation without a target goes to English."""
        extra = CanaryRequestKnobs.parse(spec.model_kwargs)
        source = _language(spec.language or extra.language, "language", "en")
        default_target = "en" if spec.task == "translate" else source
        target = _language(extra.target_language, "target_language", default_target)
        if spec.task == "translate" and target == source:
            raise RequestError("language", "a translation needs the speech's language (model_kwargs.language) "
                                           "to differ from the target's")
        if source != target and "en" not in (source, target):
            raise RequestError("target_language", f"Canary translates to or from English, not {source} to {target}")
        return source, target, extra.punctuation

    def transcription_of(self, spec: GenerateSpec) -> TranscriptionSpec:
        """``/generate`` with one audio file: its ``model_kwargs`` are the options."""
        return options_transcription(spec, self.key, CanaryRequestKnobs)

    async def transcribe(self, spec: TranscriptionSpec, run: RunWalk) -> Transcription:
        source, target, punctuation = self.options(spec)
        if spec.temperature:
            raise RequestError("temperature", f"model {self.key!r} decodes greedily: send 0 or leave it out")
        prompt = self.prompt(source, target, punctuation)
        return await transcribe_windows(
            spec.audio, run, lambda samples: self.clip_request(samples, prompt), sample_rate=SAMPLE_RATE,
            max_bytes=self.knobs.max_upload_bytes, max_seconds=self.knobs.max_audio_seconds,
            max_window_s=self.knobs.max_clip_seconds, min_samples=self.mel.hop_length, language=target,
            parallel=self.config.max_concurrent_requests)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        ckpt = self.checkpoint()
        dtype = self.config.torch_dtype()
        model = ckpt.load_model(device, dtype, dummy=self.config.load_format == "dummy", seed=self.knobs.seed)
        kv = self.config.resources.kv_cache
        return canary_engines(model, nodes, num_pages=kv.max_num_pages, page_size=kv.page_size, device=device,
                              dtype=dtype)


__all__ = ["Canary"]
