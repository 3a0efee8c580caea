"""Orpheus TTS: a Llama talker emitting audio tokens, decoded by SNAC while it talks.

Two partitions joined by a StreamEdge. The talker's chat-like walk (prefill, Loop of
decodes) writes an audio ``code`` on every audio token; the edge hands windows of 28 codes
(4 frames) every 7 codes (1 frame) to the SNAC node, which keeps the frames it decodes with
enough context and emits their samples at once.
"""

from __future__ import annotations

import torch

from mstar.contract import GenerateSpec, RequestError, SpeechSpec, Voice
from mstar.engine.base import StatelessEngine
from mstar.engine.cuda_graphs import buckets_up_to
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
from mstar.model.decode_engines import decode_engine
from mstar.model.decoding import decode_request
from mstar.model.orpheus import engine as talk
from mstar.model.orpheus.checkpoint import OrpheusCheckpoint, dummy_snac
from mstar.model.orpheus.knobs import OrpheusGenerateKnobs, OrpheusKnobs, SpeechKnobs
from mstar.model.registry import register
from mstar.model.sentences import SentenceChunker
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.speech_output import PcmStream, check_speech_generate, pcm_to_array

__all__ = ["Orpheus", "PcmStream", "pcm_to_array"]  # pcm_to_array: re-exported for tests

VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
SAMPLE_RATE = 24000
MAX_INPUT_CHARS = 4096
WINDOW = 28  # codes the codec decodes at once: 4 frames
DEFAULTS = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1}
PIECES = SentenceChunker(limit=400, first_target=120)  # characters: a few sentences, the first short
MAX_PIECES = 32


@register
class Orpheus(ModelSpec):
    key = "orpheus"
    tasks = frozenset({"speech"})
    default_weights = "canopylabs/orpheus-3b-0.1-ft"
    sample_rate = SAMPLE_RATE
    Knobs = OrpheusKnobs
    knobs: OrpheusKnobs

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
            policy=SlidingWindow(window=WINDOW, stride=7, keep="middle", ahead=14, align=7))
        return Graph.build([talker, snac], [Walk("tts", speak, inputs="prompt_ids", streams=[decode_audio])])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> OrpheusCheckpoint:
        return OrpheusCheckpoint(self.config.model_path or self.default_weights, self.knobs.snac_path,
                                 self.config.cache_dir)

    def load_frontend(self) -> None:
        self.tokenizer = self.checkpoint().talker().tokenizer()

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    def voices(self) -> list[str]:
        return list(VOICES)

    def voice_list(self) -> list[Voice]:
        return [Voice(name, "en") for name in VOICES]

    def prepare_speech(self, spec: SpeechSpec) -> WalkRequest | list[WalkRequest]:
        if spec.speed != 1.0:
            raise RequestError("speed", "Orpheus cannot change its speaking rate; send speed 1.0")
        return self._pieces(spec.input, spec.voice, SpeechKnobs.parse(spec.model_kwargs), spec.sentence_chunking)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        check_speech_generate(self.key, spec)
        options = OrpheusGenerateKnobs.parse(spec.model_kwargs)
        return self._pieces(spec.text, options.voice, options, options.sentence_chunking)

    def _pieces(self, text: str, voice: str | None, options: SpeechKnobs,
                sentence_chunking: bool | None) -> WalkRequest | list[WalkRequest]:
        """One ``tts`` walk for the whole text, or with ``sentence_chunking`` one per sentence
        piece (the runtime plays them in order): the talker drifts on long prompts."""
        if not sentence_chunking:
            return self._speak(text, voice, options)
        pieces = PIECES.split(text)
        if len(pieces) > MAX_PIECES:
            raise RequestError("input", f"makes {len(pieces)} sentence pieces; the limit is {MAX_PIECES}")
        return [self._speak(piece, voice, options) for piece in pieces] or self._speak(text, voice, options)

    def _speak(self, text: str, voice: str | None, options: SpeechKnobs) -> WalkRequest:
        """The ``tts`` walk: ``voice: text`` between Orpheus's control tokens, then as many
        audio tokens as the budget allows."""
        text = text.strip()
        if not text:
            raise RequestError("input", "must not be empty")
        if len(text) > MAX_INPUT_CHARS:
            raise RequestError("input", f"is {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
        voice = voice or VOICES[0]
        if voice not in VOICES:
            raise RequestError("voice", f"unknown voice {voice!r}; voices are {', '.join(VOICES)}")
        sampling = options.sampling(DEFAULTS, field="model_kwargs")
        text_ids = self.tokenizer.encode(f"{voice}: {text}", add_special_tokens=True)
        ids = [talk.START_OF_HUMAN, *text_ids, talk.END_OF_TEXT, talk.END_OF_HUMAN]
        room = self.config.max_seq_len - len(ids)
        if room < 8:
            raise RequestError("input", f"is {len(ids)} tokens; max_seq_len is {self.config.max_seq_len}")
        max_tokens = min(options.max_tokens or self.knobs.max_new_tokens, room)
        audio_only = self.knobs.benchmark_audio_only
        return decode_request("tts", {"prompt_ids": torch.tensor(ids, dtype=torch.int64)}, len(ids), max_tokens,
                              sampling, [] if audio_only else [talk.END_OF_SPEECH], self.config,
                              audio_only=audio_only)

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PcmStream:
        return PcmStream(SAMPLE_RATE)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        ckpt, dummy = self.checkpoint(), self.config.load_format == "dummy"
        engines = {}
        if "llm" in nodes:
            model = ckpt.talker().load_model(device, self.config.torch_dtype(), dummy=dummy, seed=self.knobs.seed)
            engines["llm"] = decode_engine(model, self.knobs, self.config, device, talk.TalkerRules())
        if "snac_decoder" in nodes:
            decoder = dummy_snac(self.knobs.snac_config, device, self.knobs.seed + 1) if dummy else ckpt.snac(device)
            graphs = None
            if self.knobs.cuda_graphs:  # every window but a short stream's last: one replay
                most = self.config.max_concurrent_requests
                graphs = talk.SnacGraphs(decoder, WINDOW // talk.TOKENS_PER_FRAME,
                                         buckets_up_to(most))
                graphs.capture_all()
            engines["snac_decoder"] = StatelessEngine(talk.snac_fn(decoder, graphs))
        return engines

