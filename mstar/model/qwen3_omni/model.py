"""Qwen3-Omni served: the declaration.

Three nodes, each placeable on its own ranks: ``thinker`` (the MoE LLM with its audio and
vision towers: text, audio, images and videos in, text out), ``talker`` (the codec LM with the code
predictor inside its decode step) and ``code2wav`` (the codec decoder). Two walks, picked by
the request's output modalities:

* ``text`` (``["text"]``): the thinker's prefill (media spliced in) and a Loop of decodes;
  every token streams out as text. The talker and code2wav are never touched.
* ``speech`` (``["text", "audio"]``): the same thinker steps, whose last writes the states the
  talker reads; then the talker's prefill (its prompt built from them) and a Loop of decodes,
  each writing a codec frame; the frames stream to code2wav over a ``StreamEdge`` in chunks of
  ``codec_chunk_schedule`` then ``codec_chunk_frames`` frames behind ``codec_left_context``
  frames of context, and its samples stream out as audio (mono float32 PCM at 24 kHz).

The thinker speaks its whole answer before the talker starts (the talker prompt holds the
answer's first tokens), as the reference does. Requests hold their KV pages from admission:
the thinker's in ``kv_pages``, the talker's (prompt plus ``max_speech_frames``) in
``talker_kv_pages``.
"""

from __future__ import annotations

from pathlib import PurePath

import torch

from mstar.contract import ChatSpec, GenerateSpec, OutputEvent, RequestError, SamplingParams, Voice
from mstar.distributed.dims import ParallelDims
from mstar.engine.base import StatelessEngine
from mstar.graph import Emit, Graph, Loop, Node, ScheduledChunks, Sequential, Step, StreamEdge, Walk
from mstar.model.chat import ChatLLM
from mstar.model.decoding import checked_sampling, kv_pages
from mstar.model.qwen3_omni import prompt as omni_prompt
from mstar.model.qwen3_omni.checkpoint import Qwen3OmniCheckpoint
from mstar.model.qwen3_omni.engine import MEDIA_INPUTS, TALKER_STOP, THINKER_STATES
from mstar.model.qwen3_omni.knobs import Qwen3OmniGenerateKnobs, Qwen3OmniKnobs
from mstar.model.qwen3_omni.parallel import omni_dims
from mstar.model.registry import register
from mstar.model.spec import OutputStream, WalkRequest
from mstar.model.text_stream import TextStream

THINKER, TALKER, CODE2WAV = "thinker", "talker", "code2wav"
TALKER_PAGES = "talker_kv_pages"
SAMPLE_RATE = 24000
ASSISTANT_ROWS = 9  # the talker prompt's rows after the user turns
# the reference's talker sampling (``talker_do_sample``), for a request that samples
TALKER_SAMPLING = {"temperature": 0.9, "top_k": 50, "repetition_penalty": 1.05}
OUTPUTS = ({"text"}, {"text", "audio"})


@register
class Qwen3Omni(ChatLLM):
    key = "qwen3_omni"
    tasks = frozenset({"chat"})
    default_weights = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
    input_modalities = frozenset({"text", "image", "video", "audio"})
    output_modalities = frozenset({"text", "audio"})
    sample_rate = SAMPLE_RATE
    Knobs = Qwen3OmniKnobs
    knobs: Qwen3OmniKnobs
    GenerateKnobs = Qwen3OmniGenerateKnobs
    kv_upfront = True  # neither LLM is preempted: their inputs are not recomputed from token ids

    @property
    def chat_walk(self) -> str:
        return "text"

    def graph(self) -> Graph:
        thinker = Node(THINKER, "autoregressive", inputs=("prompt_ids", *MEDIA_INPUTS, "token"),
                       outputs=("token", *THINKER_STATES), ops=("prefill", "decode"), flags=("stop",))
        talker = Node(TALKER, "autoregressive", inputs=(*THINKER_STATES, "token"), outputs=("token", "codes"),
                      ops=("prefill", "decode"), flags=(TALKER_STOP,))
        code2wav = Node(CODE2WAV, "stream", inputs=("codes",), outputs=("audio",))
        text = Emit("token", "text")

        def think(writes) -> Sequential:
            return Sequential(
                Step(THINKER, "prefill", reads=("prompt_ids", *MEDIA_INPUTS), writes=writes, emit=text),
                Loop(Step(THINKER, "decode", reads="token", writes=writes, emit=text),
                     until="stop", max_iters="max_decode_steps"))

        codes = {"token": "code0", "codes": "codes"}
        speak = Sequential(
            think(("token", *THINKER_STATES)),
            Step(TALKER, "prefill", reads=THINKER_STATES, writes=codes),
            Loop(Step(TALKER, "decode", reads={"token": "code0"}, writes=codes),
                 until=TALKER_STOP, max_iters="talker_decode_steps"))
        knobs = self.knobs
        policy = ScheduledChunks(tuple(knobs.codec_chunk_schedule), knobs.codec_chunk_frames, knobs.codec_left_context)
        decode = StreamEdge("codes", into=Step(CODE2WAV, reads="codes", writes="audio", emit=Emit("audio", "audio")),
                            policy=policy)
        inputs = ("prompt_ids", *MEDIA_INPUTS)
        return Graph.build([thinker, talker, code2wav], [Walk("text", think("token"), inputs=inputs),
                                                         Walk("speech", speak, inputs=inputs, streams=[decode])])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> Qwen3OmniCheckpoint:
        return Qwen3OmniCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir,
                                          dummy=self.config.load_format == "dummy")

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.tokenizer = ckpt.tokenizer()
        self.front = omni_prompt.PromptBuilder.from_checkpoint(ckpt, self.tokenizer, self.knobs)
        self.stop_token_ids = self.stop_ids(self.front.eos, *ckpt.generation_eos(), self.front.tokens.im_end)
        self.speakers = self.front.speakers

    def default_capacity(self) -> dict[str, int]:
        return super().default_capacity() | {TALKER_PAGES: self.knobs.talker_kv_pages}

    def parallel_dims(self) -> dict[str, ParallelDims]:
        """``thinker`` and ``talker`` split over ``tp_size`` ranks (``parallel.omni_dims``);
        ``code2wav`` runs whole on one rank (its own node group)."""
        return omni_dims(self.checkpoint().hf_config())

    def voices(self) -> list[str]:
        return list(getattr(self, "speakers", ()))  # none until the checkpoint is read

    def voice_list(self) -> list[Voice]:
        return [Voice(name) for name in self.voices()]

    def prepare_chat(self, spec: ChatSpec) -> WalkRequest:
        checked_sampling(spec.sampling)
        outputs = set(spec.output_modalities or ["text"])
        if outputs not in OUTPUTS:
            raise RequestError("output_modalities", f"must be ['text'] or ['text', 'audio'], got "
                                                    f"{list(spec.output_modalities)}")
        speaker = self._speaker(spec.audio) if "audio" in outputs else None
        messages, media = self.front.split(spec.messages)
        if speaker is not None and any(not isinstance(m, omni_prompt.Clip) for m in media):
            raise RequestError("output_modalities", "a spoken answer to a prompt with images or videos is not "
                                                    "supported yet (the talker's positions for them); ask for "
                                                    "['text']")
        ids = self.chat_ids(messages)
        ids, inputs = self.front.expand(ids, media)
        request = self.text_request(ids, spec.max_tokens, spec.sampling, spec.ignore_eos)
        request.inputs.update(inputs)
        if speaker is not None:
            self._speak(request, ids, speaker, spec.sampling)
        return request

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if not spec.text:
            raise RequestError("text", "must not be empty")
        options = self.GenerateKnobs.parse(spec.model_kwargs)
        outputs = list(spec.output_modalities or ["text"])
        if set(outputs) == {"audio"}:
            outputs = ["text", "audio"]  # a spoken answer always comes with its text
        content: str | list[dict] = spec.text
        if spec.files:  # the files first, in upload order, then the text
            content = [_file_part(name, data) for name, data in spec.files] + [{"type": "text", "text": spec.text}]
        if not options.chat:
            raise RequestError("model_kwargs.chat", "Qwen3-Omni answers chats only (chat: true)")
        audio = {"voice": options.voice} if options.voice is not None else None
        return self.prepare_chat(ChatSpec(spec.request_id, [{"role": "user", "content": content}],
                                          options.sampling(), options.max_tokens, output_modalities=outputs,
                                          audio=audio))

    def text_request(self, ids: list[int], max_tokens: int | None, sampling, ignore_eos: bool, *,
                     prompt_field: str = "messages") -> WalkRequest:
        request = super().text_request(ids, max_tokens, sampling, ignore_eos, prompt_field=prompt_field)
        request.inputs.update(self.front.no_media())
        return request

    def _speaker(self, audio: dict | None) -> int:
        voice = (audio or {}).get("voice") or self.knobs.default_voice or next(iter(self.speakers), None)
        if voice is None:
            raise RequestError("audio.voice", "this checkpoint has no speakers (talker_config.speaker_id)")
        found = {name.lower(): name for name in self.speakers}.get(str(voice).lower())
        if found is None:
            raise RequestError("audio.voice", f"unknown voice {voice!r}; voices are {', '.join(self.speakers)}")
        return self.speakers[found]

    def _speak(self, request: WalkRequest, ids: list[int], speaker: int, sampling: SamplingParams) -> None:
        """The ``speech`` walk: the thinker keeps what the talker reads; the talker's budget and
        pages (its prompt is at most the thinker's prompt plus the assistant rows)."""
        frames = self.knobs.max_speech_frames
        talker_sampling = {"temperature": 0.0} if sampling.greedy else {**TALKER_SAMPLING, "seed": sampling.seed}
        pages = kv_pages(len(ids) + ASSISTANT_ROWS + frames, self.config)
        request.walk = "speech"
        request.params.update(keep_states=True, prompt_len=len(ids), speaker_id=speaker,
                              talker_sampling=talker_sampling, talker_max_frames=frames,
                              talker_decode_steps=frames - 1)
        request.cost[TALKER_PAGES] = pages
        request.peak[TALKER_PAGES] = pages

    def output_stream(self, request: WalkRequest, stop: list[str]) -> OutputStream:
        return OmniStream(self.tokenizer, stop, SAMPLE_RATE, speaks=request.walk == "speech")

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.qwen3_omni.engine import code2wav_fn, talker_engine, thinker_engine

        ckpt, dtype = self.checkpoint(), self.config.torch_dtype()
        dummy, seed = self.config.load_format == "dummy", self.knobs.seed
        tokens, accept = omni_prompt.chat_tokens(ckpt.hf_config()), omni_prompt.accept_hidden_layer(ckpt.hf_config())
        kv = self.config.resources.kv_cache
        backend = self.knobs.attention_backend
        engines = {}
        if THINKER in nodes:
            thinker = ckpt.thinker(device, dtype, dummy=dummy, seed=seed)
            thinker.use_fused_kernels(self.knobs.fused_kernels)
            engines[THINKER] = thinker_engine(thinker, tokens, keep_layer=accept, num_pages=kv.max_num_pages,
                                              page_size=kv.page_size, max_seq_len=self.config.max_seq_len,
                                              device=device, dtype=dtype, attention_backend=backend)
        if TALKER in nodes:
            talker = ckpt.talker(device, dtype, dummy=dummy, seed=seed + 1)
            talker.use_fused_kernels(self.knobs.fused_kernels)
            longest = self.config.max_seq_len + ASSISTANT_ROWS + self.knobs.max_speech_frames
            engines[TALKER] = talker_engine(talker, tokens, num_pages=self.knobs.talker_kv_pages,
                                            page_size=kv.page_size, max_seq_len=longest, device=device,
                                            dtype=dtype, attention_backend=backend)
        if CODE2WAV in nodes:  # float32 always: a waveform decoder is phase-sensitive, and small
            decoder = ckpt.code2wav(device, torch.float32, dummy=dummy, seed=seed + 2)
            engines[CODE2WAV] = StatelessEngine(code2wav_fn(decoder))
        return engines


class OmniStream(OutputStream):
    """The answer's tokens as text (``TextStream``) and, for a spoken answer, its audio chunks as
    mono float32 little-endian PCM at ``sample_rate``."""

    def __init__(self, tokenizer, stop: list[str], sample_rate: int, *, speaks: bool) -> None:
        self.text = TextStream(tokenizer, stop)
        self.sample_rate = sample_rate
        self.speaks = speaks
        self.samples = 0

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        if modality != "audio":
            return self.text.feed(modality, value)
        pcm = value.detach().float().reshape(-1).numpy().astype("<f4")
        self.samples += pcm.size
        return OutputEvent(modality="audio", data=pcm.tobytes()) if pcm.size else None

    def finish(self, reason: str) -> OutputEvent | None:
        return self.text.finish(reason)

    @property
    def generated(self) -> int:
        return self.text.generated

    @property
    def media_seconds(self) -> float | None:
        return self.samples / self.sample_rate if self.speaks else None

    @property
    def stopped(self) -> bool:
        return self.text.stopped


AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus"}


VIDEO_SUFFIXES = {".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi"}


def _file_part(name: str, data: bytes) -> dict:
    """A ``/generate`` upload as a content part: audio or video by its suffix or header, else an image."""
    head, suffix = bytes(data[:12]), PurePath(name).suffix.lower()
    if suffix in VIDEO_SUFFIXES or head[4:8] == b"ftyp" or head.startswith(b"\x1a\x45\xdf\xa3"):
        return {"type": "video", "data": data}  # ISO media (mp4, mov) or Matroska (mkv, webm)
    audio = (suffix in AUDIO_SUFFIXES or head.startswith((b"RIFF", b"fLaC", b"OggS", b"ID3"))
             or head[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"))
    return {"type": "audio" if audio else "image", "data": data}

