"""Orpheus TTS: a Llama talker emitting audio tokens, decoded by SNAC while it talks.

Two partitions joined by a StreamEdge. The talker's chat-like walk (prefill, Loop of
decodes) writes an audio ``code`` on every audio token; the edge hands windows of 28 codes
(4 frames) every 7 codes (1 frame) to the SNAC node, which keeps the frames it decodes with
enough context and emits their samples at once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from mstar.contract import (
    GenerateSpec,
    OutputEvent,
    RequestError,
    SamplingParams,
    SpeechSpec,
)
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import StatelessEngine
from mstar.engine.sampler import validate_sampling
from mstar.graph import (
    Emit,
    Graph,
    Loop,
    Node,
    Sequential,
    SlidingWindow,
    Step,
    StreamEdge,
    Walk,
)
from mstar.model.llama.checkpoint import LlamaCheckpoint
from mstar.model.llama.model import apply_fused_kernels, decode_fast_paths
from mstar.model.llama.modeling import LlamaForCausalLM
from mstar.model.orpheus import engine as talk
from mstar.model.registry import register
from mstar.model.snac import SnacConfig, SnacDecoder, load_snac_state_dict
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest

log = logging.getLogger(__name__)

VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
SAMPLE_RATE = 24000
MAX_INPUT_CHARS = 4096
DEFAULTS = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1}


class PcmStream(OutputStream):
    """Emitted audio chunks -> events carrying float32 PCM bytes."""

    def __init__(self):
        self.samples = 0

    @property
    def generated(self) -> int:
        return self.samples

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        pcm = value.detach().float().reshape(-1).numpy().astype("<f4")
        self.samples += pcm.size
        return OutputEvent(modality="audio", data=pcm.tobytes()) if pcm.size else None


@register
class Orpheus(ModelSpec):
    key = "orpheus"
    tasks = frozenset({"speech"})
    default_weights = "canopylabs/orpheus-3b-0.1-ft"
    sample_rate = SAMPLE_RATE

    def graph(self) -> Graph:
        talker = Node("llm", "autoregressive", inputs=("prompt_ids", "token"), outputs=("token", "code"),
                      ops=("prefill", "decode"), flags=("stop",))
        snac = Node("snac_decoder", "stream", inputs=("codes",), outputs=("audio",))
        speak = Sequential(
            Step("llm", "prefill", reads="prompt_ids", writes=("token", "code")),
            Loop(Step("llm", "decode", reads="token", writes=("token", "code")),
                 until="stop", max_iters="max_decode_steps"),
        )
        decode_audio = StreamEdge(
            "code", into=Step("snac_decoder", reads="codes", writes="audio", emit=Emit("audio", "audio")),
            policy=SlidingWindow(window=28, stride=7, keep="middle", ahead=14, align=7))
        return Graph.build([talker, snac], [Walk("tts", speak, inputs="prompt_ids", streams=[decode_audio])])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> LlamaCheckpoint:
        return LlamaCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        self.tokenizer = self.checkpoint().tokenizer()
        self.max_new_tokens = int(self.config.model_kwargs.get("max_new_tokens", 1200))
        # Benchmarking only: every request speaks its whole token budget as audio codes
        # (sampling restricted to the valid code of each position, END_OF_SPEECH ignored), so
        # that dummy weights produce a fixed amount of audio. Never set it to serve users.
        self.benchmark_audio_only = bool(self.config.model_kwargs.get("benchmark_audio_only", False))

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    def voices(self) -> list[str]:
        return list(VOICES)

    def prepare_speech(self, spec: SpeechSpec) -> WalkRequest:
        text = spec.input.strip()
        if not text:
            raise RequestError("input", "must not be empty")
        if len(text) > MAX_INPUT_CHARS:
            raise RequestError("input", f"is {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
        voice = spec.voice or VOICES[0]
        if voice not in VOICES:
            raise RequestError("voice", f"unknown voice {voice!r}; voices are {', '.join(VOICES)}")
        if spec.speed != 1.0:
            raise RequestError("speed", "Orpheus cannot change its speaking rate; send speed 1.0")
        kwargs = dict(spec.model_kwargs)
        max_tokens = int(kwargs.pop("max_tokens", self.max_new_tokens))
        fields = {**DEFAULTS, **{k: kwargs.pop(k) for k in SamplingParams.__struct_fields__ if k in kwargs}}
        if kwargs:
            raise RequestError("model_kwargs", f"unknown keys {sorted(kwargs)}")
        try:
            sampling = SamplingParams(**fields)
            validate_sampling(sampling)
        except (TypeError, ValueError) as err:
            raise RequestError("model_kwargs", str(err)) from None
        text_ids = self.tokenizer.encode(f"{voice}: {text}", add_special_tokens=True)
        ids = [talk.START_OF_HUMAN, *text_ids, talk.END_OF_TEXT, talk.END_OF_HUMAN]
        room = self.config.max_seq_len - len(ids)
        if room < 8:
            raise RequestError("input", f"is {len(ids)} tokens; max_seq_len is {self.config.max_seq_len}")
        if not 1 <= max_tokens:
            raise RequestError("max_tokens", "must be >= 1")
        max_tokens = min(max_tokens, room)
        params = {
            "sampling": {f: getattr(sampling, f) for f in sampling.__struct_fields__},
            "max_new_tokens": max_tokens,
            "max_decode_steps": max_tokens - 1,
            "stop_token_ids": [] if self.benchmark_audio_only else [talk.END_OF_SPEECH],
            "audio_only": self.benchmark_audio_only,
        }
        pages = -(-(len(ids) + max_tokens) // self.config.resources.kv_cache.page_size)
        return WalkRequest("tts", {"prompt_ids": torch.tensor(ids, dtype=torch.int64)}, params,
                           {"kv_pages": pages}, prompt_tokens=len(ids))

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if set(spec.output_modalities) != {"audio"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs audio only")
        if spec.files:
            raise RequestError("files", f"model {self.key!r} takes text only")
        kwargs = dict(spec.model_kwargs)
        voice = kwargs.pop("voice", None)
        return self.prepare_speech(SpeechSpec(spec.request_id, spec.text, voice, 1.0, kwargs))

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PcmStream:
        return PcmStream()

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        engines = {}
        dtype = self.config.torch_dtype()
        if "llm" in nodes:
            engines["llm"] = self._talker(device, dtype)
        if "snac_decoder" in nodes:
            decoder = self._snac(device)
            engines["snac_decoder"] = StatelessEngine(talk.snac_fn(decoder))
        return engines

    def _talker(self, device: torch.device, dtype: torch.dtype) -> AutoregressiveEngine:
        from mstar.model.weights import init_dummy_weights, load_weights

        ckpt = self.checkpoint()
        config = ckpt.config()
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
        if self.config.load_format == "dummy":
            init_dummy_weights(model, seed=int(self.config.model_kwargs.get("seed", 0)))
        else:
            load_weights(model, ckpt.tensors(), dtype=dtype)
        apply_fused_kernels(self.config, model, device)
        kv = self.config.resources.kv_cache
        layout = KVLayout(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        engine = AutoregressiveEngine(model.eval(), layout, num_pages=kv.max_num_pages, page_size=kv.page_size,
                                      max_seq_len=self.config.max_seq_len, device=device, dtype=dtype,
                                      rules=talk.TalkerRules(), **decode_fast_paths(self.config, device))
        if engine.graphs is not None:  # every bucket now: no request waits for a capture
            engine.graphs.capture_all()
        return engine

    def _snac(self, device: torch.device) -> SnacDecoder:
        """SNAC in float32 (its convolutions are small; bf16 costs quality for little speed)."""
        from mstar.model.weights import init_dummy_weights, resolve_model_path

        kwargs = self.config.model_kwargs
        if self.config.load_format == "dummy":
            config = SnacConfig.from_dict(kwargs.get("snac_config", {}))
            with torch.device(device):
                decoder = SnacDecoder(config)
            init_dummy_weights(decoder, seed=int(kwargs.get("seed", 0)) + 1)
            return decoder.eval()
        path = resolve_model_path(kwargs.get("snac_path", "hubertsiuzdak/snac_24khz"), cache_dir=self.config.cache_dir)
        config = SnacConfig.from_dict(json.loads((Path(path) / "config.json").read_text()))
        with torch.device(device):
            decoder = SnacDecoder(config)
        state = torch.load(Path(path) / "pytorch_model.bin", map_location=device, weights_only=True)
        load_snac_state_dict(decoder, state)
        decoder.fuse_weight_norm()
        return decoder.eval()


def pcm_to_array(events: list[OutputEvent]) -> np.ndarray:
    """The float32 samples of a request's audio events, joined."""
    return np.concatenate([np.frombuffer(e.data, "<f4") for e in events if e.data] or [np.zeros(0, "<f4")])
