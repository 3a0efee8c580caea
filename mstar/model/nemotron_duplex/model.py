"""Nemotron VoiceChat (``nemotron_duplex``): the declaration.

The walk ``duplex`` (text out; ``duplex_speech``, with the talker, is below). Its body
primes the nano LLM with the system prompt (the request's text). The user's audio is a
client stream, ``audio_in`` (16 kHz mono samples; its ``max_items`` is ``max_session_s`` of
them, counted by the frontend before any node sees an append). Two stream edges chain three
stages running asynchronously:

    audio_in --(one append a chunk)--> conformer_encoder --frames--> nano_llm.frame --agent_text-->

``conformer_encoder`` emits the frames no later audio can change (the rest at the end of
input); ``nano_llm.frame`` runs one frame-synchronous decode step per frame and emits one
agent text token per 80 ms frame, after it was primed. The walk ends when the audio does:
``end_input`` closes ``audio_in``, its end drains the encoder, which closes ``frames``.

A call that asks for audio (``output_modalities`` holding ``audio``, the default when left
out; ``["text"]`` asks for text only) takes the walk
``duplex_speech``: the same, plus a third stream edge from ``agent_text`` into the talker,
``eartts_talker``, which turns each text token into that frame's codes and, through the causal
codec in the same step, its 80 ms of 22.05 kHz PCM (``talker.py``):

    agent_text --(one token item a chunk)--> eartts_talker --agent_audio-->

Such a call also holds the talker's KV pages of its warm-up and ``max_session_s`` of frames
(two streams, the CFG pair; ``resources.talker_kv``) and a ``codec_state`` slot.

Each call holds, from admission to its end however it ends, a slot in ``encoder_state`` and
``mamba_state`` (``resources.<pool>.max_slots``, the sink included) and the KV pages of
``max_prompt_tokens`` plus one position per frame of ``max_session_s``; startup refuses a
``max_concurrent_requests`` any of them cannot hold, naming the pool's key.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np
import torch
from pydantic import Field

from mstar.audio.io import AudioError, read_frames
from mstar.config import ConfigError
from mstar.contract import GenerateSpec, OutputEvent, RequestError, SamplingParams
from mstar.graph import ClientStream, Emit, FixedFrames, Graph, Node, Step, StreamEdge, Walk
from mstar.model.decoding import checked_sampling, kv_pages, pool_for_every_request, state_capacity, state_slots
from mstar.model.knobs import Knobs, RequestKnobs
from mstar.model.nemotron_duplex.config import FRAME_SAMPLES, DuplexConfig
from mstar.model.nemotron_duplex.features import MIN_SAMPLES, SAMPLE_RATE, duplex_settings
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest

ENCODER, NANO, TALKER = "conformer_encoder", "nano_llm", "eartts_talker"
AUDIO = "audio_in"
MAX_UPLOAD_BYTES = 64 * 1024 * 1024


class DuplexKnobs(Knobs):
    max_session_s: float = 160.0
    """The longest call, in seconds of user audio: a longer upload, or a live call whose
    appends pass it, is refused (400); it sizes each call's KV pages."""
    max_prompt_tokens: int = Field(256, ge=1)
    """The longest system prompt (the request's text), in tokens: a longer one is refused
    (400 naming ``text``); with ``max_session_s`` it sizes each call's KV pages."""
    temperature: float = 0.7
    """The agent text's sampling temperature (a request's ``model_kwargs.temperature``
    overrides it; 0 is greedy)."""
    top_p: float = 0.9
    repetition_penalty: float = Field(1.0, gt=0)
    """The agent text's repetition penalty over the tokens the call said (the pad, BOS and EOS
    excepted): a positive logit divided by it, a negative one multiplied; 1 is off. A
    request's ``model_kwargs.repetition_penalty`` overrides it."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every agent text token the call said (the specials
    excepted); 0 is off. A request's ``model_kwargs.presence_penalty`` overrides it."""
    attention_backend: Literal["torch", "triton"] = "torch"
    """The nano LLM's paged-attention kernels (``docs/nemotron_h.md``); with ``cuda_graphs`` on
    CUDA the nano LLM runs ``triton`` (the torch reference cannot be captured)."""
    speaker: str | None = None
    """The talker's voice: a speaker latent of the checkpoint (None: its first)."""
    encoder_dtype: Literal["float32", "bfloat16"] = "float32"
    """The FastConformer encoder's weights and activations (the front end's log-mels stay
    float32 and are cast on entry; its frames reach the LLM in the LLM's dtype)."""
    cuda_graphs: bool = False
    """Replay the steady frame steps from CUDA graphs (on CUDA; eager elsewhere, over the same
    static buffers): the encoder's conformer blocks over one new frame a call, the nano LLM's
    one-token steps and the talker's one-frame steps, per batch bucket. Captured at start-up."""


class DuplexRequestKnobs(RequestKnobs):
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = None


@register
class NemotronDuplex(ModelSpec):
    key = "nemotron_duplex"
    tasks = frozenset()
    generate_modalities = (frozenset({"audio"}), frozenset({"text", "audio"}))
    default_generate_outputs = ("text", "audio")  # speech by default, as the reference; ["text"]: text only
    Knobs = DuplexKnobs
    knobs: DuplexKnobs
    live_stream = AUDIO  # /generate/ws appends feed this client stream of one request

    def graph(self) -> Graph:
        encoder = Node(ENCODER, "stream", inputs=("audio",), outputs=("frames",))
        nano = Node(NANO, "autoregressive", inputs=("prompt_ids", "frame", "primed"),
                    outputs=("primed", "token"), ops=("prime", "frame"))
        prime = Step(NANO, "prime", reads="prompt_ids", writes="primed")
        hear = StreamEdge(AUDIO, into=Step(ENCODER, reads={"audio": AUDIO}, writes="frames"), policy=FixedFrames(1))
        speak = StreamEdge("frames", into=Step(NANO, "frame", reads={"frame": "frames", "primed": "primed"},
                                               writes={"token": "agent_text"}, emit=Emit("agent_text", "text")),
                           policy=FixedFrames(1), port="frame")
        talker = Node(TALKER, "stream", inputs=("token",), outputs=("audio",))
        talk = StreamEdge("agent_text", into=Step(TALKER, reads={"token": "agent_text"},
                                                  writes={"audio": "agent_audio"}, emit=Emit("agent_audio", "audio")),
                          policy=FixedFrames(1))
        walks = [Walk(name, prime, inputs="prompt_ids", streams=streams,
                      client_streams=[ClientStream(AUDIO, max_items="max_samples")])
                 for name, streams in (("duplex", [hear, speak]), ("duplex_speech", [hear, speak, talk]))]
        return Graph.build([encoder, nano, talker], walks)

    # ------------------------------------------------------------- frontend
    def checkpoint_dir(self) -> Path:
        from mstar.model.weights import resolve_model_path

        if not self.config.model_path:
            raise ConfigError("model_path: nemotron_duplex needs a checkpoint folder (config.json, tokenizer)")
        return resolve_model_path(self.config.model_path, cache_dir=self.config.cache_dir)

    def load_frontend(self) -> None:
        from transformers import AutoTokenizer

        path = self.checkpoint_dir()
        self.duplex = DuplexConfig.from_dir(path)
        self.talker_config()
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def talker_config(self):
        """The talker's ``EarTTSConfig`` (read from the checkpoint folder's config.json where the
        frontend was not loaded: a worker, the startup's capacity check)."""
        duplex = getattr(self, "duplex", None) or DuplexConfig.from_dir(self.checkpoint_dir())
        if duplex.talker is None:
            raise ConfigError(f"model_path {self.config.model_path}: config.json has no speech_generation "
                              "(the talker's config)")
        return duplex.talker

    @property
    def sample_rate(self) -> int:
        """The agent's speech: 22.05 kHz mono PCM."""
        duplex = getattr(self, "duplex", None)
        return duplex.talker.codec.sample_rate if duplex is not None and duplex.talker else 22050

    def talker_kv(self) -> tuple[int, int, int]:
        """The talker's KV pool: ``(pages, page_size, pages per call)``: a call's two streams
        of its warm-up and ``max_session_s`` of frames (``resources.talker_kv``; default: as
        many pages as ``max_concurrent_requests`` calls hold)."""
        from mstar.model.eartts.engine import TalkerEngine
        from mstar.model.nemotron_duplex.talker import warmup_positions

        given = self.config.resources.talker_kv
        page_size = given.page_size if given is not None else 16
        each = TalkerEngine.kv_pages_per_session(self.max_frames, warmup_positions(self.talker_config()), page_size)
        return (given.max_num_pages if given is not None else each * self.config.max_concurrent_requests,
                page_size, each)

    @property
    def max_frames(self) -> int:
        return int(self.knobs.max_session_s * SAMPLE_RATE) // FRAME_SAMPLES + 2

    @property
    def call_positions(self) -> int:
        """The KV positions a call may come to hold: its prompt, then one per frame."""
        return self.knobs.max_prompt_tokens + self.max_frames

    def default_capacity(self) -> dict[str, int]:
        if self.call_positions > self.config.max_seq_len:
            raise ConfigError(f"max_seq_len ({self.config.max_seq_len}) cannot hold a call of "
                              f"model_kwargs.max_prompt_tokens ({self.knobs.max_prompt_tokens}) and max_session_s "
                              f"({self.knobs.max_session_s} s: {self.max_frames} frames)")
        what = "model_kwargs.max_prompt_tokens and max_session_s of frames"
        capacity = (pool_for_every_request(self.config, self.call_positions, what)
                    | {"mamba_slots": state_capacity(self.config, "mamba_state"),
                       "encoder_slots": state_capacity(self.config, "encoder_state"),
                       "codec_slots": state_capacity(self.config, "codec_state")})
        pages, _, each = self.talker_kv()
        need = each * self.config.max_concurrent_requests
        if pages < need:
            raise ConfigError(f"resources.talker_kv.max_num_pages ({pages}) cannot hold max_concurrent_requests "
                              f"({self.config.max_concurrent_requests}) calls of {each} pages each (the talker's "
                              f"warm-up and max_session_s of frames, two streams): set it to at least {need} or lower "
                              "max_concurrent_requests")
        return capacity | {"talker_pages": pages}

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        options = DuplexRequestKnobs.parse(spec.model_kwargs)
        prompt = self.system_prompt(spec.text)
        if len(prompt) > self.knobs.max_prompt_tokens:
            raise RequestError("text", f"the system prompt is {len(prompt)} tokens; the deployment's "
                                       f"max_prompt_tokens is {self.knobs.max_prompt_tokens}")
        sampling = checked_sampling(SamplingParams(
            temperature=self.knobs.temperature if options.temperature is None else options.temperature,
            top_p=self.knobs.top_p if options.top_p is None else options.top_p, seed=options.seed))
        clips = [self.decode_audio(data, f"files[{i}]", upload=True) for i, (_, data) in enumerate(spec.files)]
        penalties = {"repetition": self.knobs.repetition_penalty if options.repetition_penalty is None
                     else options.repetition_penalty,
                     "presence": self.knobs.presence_penalty if options.presence_penalty is None
                     else options.presence_penalty}
        params = {"sampling": msgspec.structs.asdict(sampling), "max_new_tokens": 1 << 30, "stop_token_ids": [],
                  "text_penalties": penalties,
                  "max_samples": int(self.knobs.max_session_s * SAMPLE_RATE),
                  # the talker's noise: the request's seed, else a fresh one
                  "talker_seed": options.seed if options.seed is not None else secrets.randbits(62)}
        if not spec.live_input and sum(c.shape[0] for c in clips) < MIN_SAMPLES:
            raise RequestError("files", f"a one-shot call needs an audio clip of at least {MIN_SAMPLES} samples "
                                        "(16 kHz)")
        if sum(c.shape[0] for c in clips) > params["max_samples"]:
            raise RequestError("files", f"the audio is longer than max_session_s ({self.knobs.max_session_s} s)")
        cost = {"kv_pages": kv_pages(self.call_positions, self.config), "mamba_slots": 1, "encoder_slots": 1}
        speaks = "audio" in spec.output_modalities
        if speaks:
            cost |= {"talker_pages": self.talker_kv()[2], "codec_slots": 1}
        return WalkRequest("duplex_speech" if speaks else "duplex",
                           {"prompt_ids": torch.tensor(prompt, dtype=torch.int64)}, params, cost=cost,
                           prompt_tokens=len(prompt), appends={AUDIO: clips} if clips else {},
                           end_input=not spec.live_input)

    def system_prompt(self, text: str | None) -> list[int]:
        """The prompt's token ids as NeMo's duplex data lays them out: BOS, the text, EOS;
        nothing at all without text (the first frame is then the call's first position)."""
        if not text:
            return []
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.duplex.eos_token_id
        return ([] if bos is None else [bos]) + ids + ([] if eos is None else [eos])

    def append_item(self, data: bytes, field: str) -> torch.Tensor:
        """A live call's append: one 16 kHz mono audio file."""
        return self.decode_audio(data, field)

    def decode_audio(self, data: bytes, field: str, *, upload: bool = False) -> torch.Tensor:
        """One clip (a WAV/FLAC/OGG file) as 16 kHz mono samples. An append must be 16 kHz
        mono as it is (a per-append resampler would put a seam at every append); an upload
        may have two channels (a conversation's recording: the user is the left one)."""
        if len(data) > MAX_UPLOAD_BYTES:
            raise RequestError(field, f"is {len(data)} bytes; the limit is {MAX_UPLOAD_BYTES}", 413)
        try:
            frames, rate = read_frames(data, self.knobs.max_session_s, field)
        except AudioError as err:
            raise RequestError(field, err.message, err.status) from None
        if rate != SAMPLE_RATE:
            raise RequestError(field, f"must be {SAMPLE_RATE} Hz audio, got {rate} Hz (it is not resampled)")
        channels = frames.shape[1]
        if channels > (2 if upload else 1):
            raise RequestError(field, f"must be mono{' or two-channel (user left)' if upload else ''} audio, "
                                      f"got {channels} channels")
        samples = np.ascontiguousarray(frames[:, 0], dtype=np.float32)
        if not np.isfinite(samples).all():
            raise RequestError(field, "holds non-finite samples")
        return torch.from_numpy(samples)

    def output_stream(self, request: WalkRequest, stop: list[str]) -> OutputStream:
        return AgentText(self.tokenizer, self.duplex.agent_pad_token_id, self.sample_rate)

    # --------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        """Each node's module built on ``device`` in its dtype at once (``building``: no
        float32 copy of a bf16 model is ever held), then filled: dummy weights drawn there,
        or the checkpoint's tensors. The Mamba-2 states stay float32."""
        from mstar.model.nemotron_duplex.checkpoint import load_encoder, load_llm
        from mstar.model.nemotron_duplex.engines import EncoderEngine, NanoEngine, duplex_rules
        from mstar.model.nemotron_duplex.modeling import DuplexLLM, SpeechEncoder
        from mstar.model.nemotron_h.engine import nemotron_h_engine
        from mstar.model.weights import building, init_dummy_weights

        folder = self.checkpoint_dir()
        config = DuplexConfig.from_dir(folder)
        dummy = self.config.load_format == "dummy"
        dtype = self.config.torch_dtype()
        engines = {}
        if ENCODER in nodes:
            with building(device, getattr(torch, self.knobs.encoder_dtype)):
                encoder = SpeechEncoder(config)
            if dummy:
                init_dummy_weights(encoder, seed=self.knobs.seed)
            else:
                load_encoder(encoder, folder)
            engines[ENCODER] = EncoderEngine(encoder.eval(), duplex_settings(config.n_mels),
                                             max_slots=state_slots(self.config, "encoder_state"),
                                             cuda_graphs=self.knobs.cuda_graphs)
            engines[ENCODER].capture_all()
        if TALKER in nodes:
            engines[TALKER] = self._talker(config, device, dtype)
        if NANO in nodes:
            with building(device, dtype):
                llm = DuplexLLM(config.llm, function_head=config.use_function_head)
            if dummy:
                init_dummy_weights(llm, seed=self.knobs.seed + 1)
            else:
                load_llm(llm, folder)
            kv = self.config.resources.kv_cache
            inner = nemotron_h_engine(llm.eval(), max_slots=state_slots(self.config, "mamba_state"),
                                      state_dtype=torch.float32, num_pages=kv.max_num_pages, page_size=kv.page_size,
                                      max_seq_len=self.config.max_seq_len, device=device, dtype=dtype,
                                      rules=duplex_rules(config), **self._nano_graphs(device))
            if inner.graphs is not None:  # every bucket now: no call waits on a capture mid-stream
                inner.graphs.capture_all()
            engines[NANO] = NanoEngine(inner, llm, pad_token_id=config.agent_pad_token_id,
                                       user_weight=config.user_channel_weight,
                                       text_weight=config.text_channel_weight,
                                       function_weight=config.function_channel_weight)
        return engines

    def _nano_graphs(self, device: torch.device) -> dict:
        """The nano LLM engine's attention backend and graph switches. With ``cuda_graphs`` its
        one-token steps replay a graph per batch bucket up to ``max_concurrent_requests``, and on
        CUDA the attention runs the Triton kernels whatever ``attention_backend`` says: the torch
        reference reads the step's lengths back on the host, which a capture cannot hold (off
        CUDA the graphs run eagerly, and the torch reference is kept)."""
        if not self.knobs.cuda_graphs:
            return {"attention_backend": self.knobs.attention_backend}
        from mstar.engine.cuda_graphs import buckets_up_to

        return {"attention_backend": "triton" if device.type == "cuda" else self.knobs.attention_backend,
                "cuda_graphs": True, "graph_batch_sizes": buckets_up_to(self.config.max_concurrent_requests)}

    def _talker(self, config: DuplexConfig, device: torch.device, dtype: torch.dtype):
        from mstar.model.eartts.engine import TalkerEngine, Warmup
        from mstar.model.nemotron_duplex.talker import TalkerNode, dummy_talker, prompt_frames, warmup_positions

        talker_config = config.talker
        if self.config.load_format == "dummy":
            model = dummy_talker(talker_config, config.llm.vocab_size, self.knobs.seed + 2, device=device, dtype=dtype)
        else:
            from transformers import AutoTokenizer

            from mstar.model.nemotron_duplex.talker import checkpoint_talker

            vocab = AutoTokenizer.from_pretrained(self.checkpoint_dir()).get_vocab()
            model = checkpoint_talker(talker_config, self.checkpoint_dir(), vocab, config.llm.vocab_size,
                                      device=device, dtype=dtype)
        model = model.eval()
        name = self.knobs.speaker or next(iter(model.speakers))
        if name not in model.speakers:
            raise ConfigError(f"model_kwargs.speaker: no speaker {name!r}; the checkpoint has {sorted(model.speakers)}")
        warmup = Warmup.for_speaker(model.speakers[name].to(device, dtype), model.silence_codes,
                                    prompt_frames=prompt_frames(talker_config),
                                    text_pad_id=config.agent_pad_token_id, text_eos_id=config.eos_token_id,
                                    codebook_size=talker_config.talker.codebook_size)
        pages, page_size, _ = self.talker_kv()
        # With graphs on CUDA the Triton kernels (no host sync; no window, and the released one
        # is wider than a call's stream: the engine checks it against max_positions).
        graphs = self.knobs.cuda_graphs
        engine = TalkerEngine(model, max_sessions=state_slots(self.config, "codec_state") - 1, num_pages=pages,
                              page_size=page_size, text_eos_id=config.eos_token_id,
                              max_positions=warmup_positions(talker_config) + self.max_frames,
                              attention_backend="triton" if graphs and device.type == "cuda" else "torch",
                              cuda_graphs=graphs)
        engine.capture_all()  # every bucket up to the deployment's calls, before any call
        return TalkerNode(engine, warmup)


class AgentText(OutputStream):
    """Each agent frame's text token: its id, and its text (the pad, the agent's "no text",
    and other special tokens show as nothing); the agent's speech as float32 PCM."""

    def __init__(self, tokenizer, pad_id: int, sample_rate: int) -> None:
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.sample_rate = sample_rate
        self.count = 0

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        if modality == "audio":
            samples = value.reshape(-1).to(torch.float32).numpy()
            return OutputEvent(modality="audio", data=samples.astype("<f4").tobytes()) if samples.size else None
        ids = [int(t) for t in value.reshape(-1).tolist()]
        self.count += len(ids)
        said = [t for t in ids if t != self.pad_id]
        text = self.tokenizer.decode(said, skip_special_tokens=True) if said else ""
        return OutputEvent(modality="text", text=text, token_ids=ids)

    @property
    def generated(self) -> int:
        return self.count

