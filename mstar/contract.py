"""The request contract: what a validated request is, what its output events are, and the
errors a client can be told about.

Every layer shares these types: the HTTP server builds the specs, a model's ``prepare_*``
reads them and raises ``RequestError``, the runtime streams ``OutputEvent``s back. This
module sits below all of them and imports nothing of M* (and no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How one request picks its next token.

    ``temperature == 0`` is greedy. ``top_k <= 0`` disables top-k; ``top_p == 1`` and
    ``min_p == 0`` disable those filters; ``repetition_penalty == 1`` disables the penalty.
    ``seed`` makes a request's samples reproducible whatever it is batched with.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestError(Exception):
    """A client mistake: becomes an HTTP 4xx whose body names ``field`` and the rule."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status


class Overloaded(RequestError):
    """The server cannot take the request now (its wait queue is full): an HTTP 429 with a
    ``Retry-After`` of ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__("server", message, 429)
        self.retry_after_s = retry_after_s


class ServiceError(RequestError):
    """The server could not finish the request (a timeout: 504, a dead worker: 503). Routes
    answer it like a ``RequestError`` with its status, naming no field."""

    def __init__(self, message: str, status: int = 500):
        Exception.__init__(self, message)
        self.field = None
        self.message = message
        self.status = status


TASKS: tuple[str, ...] = ("chat", "text_completion", "transcription", "translation", "speech", "image_generation",
                          "image_edit", "video_generation", "realtime")
"""What a model can serve; each model spec declares its own in ``tasks``. ``chat``: chat
completions; ``text_completion``: OpenAI's legacy completions, a raw prompt continued with
no chat template; ``transcription``: speech to text in its language; ``translation``: speech
to English text; ``speech``: text to speech; ``image_generation``: text to image;
``image_edit``: images and text to image; ``video_generation``: text (and an image) to video
(/v1/videos/generations, the /v1/videos jobs); ``realtime``: a spoken conversation, the user's
speech in, the reply's text and speech out (the Realtime API, a many-model deployment). The
HTTP server checks a request's task against the served model's before the model sees it
(/generate serves every model: each family maps it onto what it does)."""


@dataclass(frozen=True)
class ChatSpec:
    """One chat request, validated by the HTTP layer.

    Each message is ``{"role", "content"}``. For a text-only model ``content`` is a string;
    for a model that reads media (``input_modalities`` beyond text) it may be a list of parts
    ``{"type": "text", "text": str}`` / ``{"type": "image" | "video" | "audio", "data": bytes}``,
    the bytes fetched but not decoded (an audio part's are the uploaded file: wav, flac, mp3,
    ogg). ``enable_thinking``: the chat template's switch (None: the template's default);
    models without one ignore it. ``output_modalities``: what the answer is made of (``["text"]``,
    or ``["text", "audio"]`` for a model that speaks its answer); ``audio``: OpenAI's audio
    output options, ``{"voice": str, "format": str}``."""

    request_id: str
    messages: list[dict]
    sampling: SamplingParams
    max_tokens: int | None  # None: up to the context limit
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    enable_thinking: bool | None = None
    output_modalities: list[str] = field(default_factory=lambda: ["text"])
    audio: dict | None = None


@dataclass(frozen=True)
class CompletionSpec:
    """One text completion request (OpenAI's legacy completions), validated by the HTTP layer.

    ``prompt`` is continued as it is, with no chat template: a string (tokenised with the
    tokenizer's special tokens when ``add_special_tokens``, a BOS for Llama 3, say) or the
    token ids themselves. ``echo``: the prompt's text goes out ahead of the completion."""

    request_id: str
    prompt: str | list[int]
    sampling: SamplingParams
    max_tokens: int | None  # None: up to the context limit
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    echo: bool = False
    add_special_tokens: bool = True


@dataclass(frozen=True)
class VoiceClip:
    """A reference clip to clone a voice from (``ref_audio``), decoded and checked by the API
    server before the model sees it: ``pcm`` is mono float32 little-endian samples at the
    clip's own ``sample_rate`` (each family resamples to what its encoders read), ``text`` its
    transcript (``ref_text``) when the client sent one."""

    pcm: bytes
    sample_rate: int
    text: str | None = None

    @property
    def duration(self) -> float:
        return len(self.pcm) / 4 / self.sample_rate


@dataclass(frozen=True)
class Voice:
    """One voice a speech model offers (/v1/audio/voices): its ``name`` (what ``voice`` takes),
    its ``language`` (an ISO-639-1 code) where known, and where it comes from: ``bundled``
    with the weights, or a ``preset`` clip of the deployment's ``voices_dir``."""

    name: str
    language: str | None = None
    source: str = "bundled"


@dataclass(frozen=True)
class SessionSpec:
    """A request's world-state session (``/generate``'s ``session_id``, ``resume_session``,
    ``end_session``, ``session_timeout_s``; see ``mstar.runtime.sessions``). ``timeout_s`` is
    what the client asked for; the runtime caps it at the deployment's maximum."""

    session_id: str
    resume: bool = False
    end: bool = False
    timeout_s: float = 600.0


@dataclass(frozen=True)
class GenerateSpec:
    """One native /generate request. ``reference``: the voice to clone (``model_kwargs``'
    ``ref_audio`` and ``ref_text``, resolved and decoded by the route)."""

    request_id: str
    text: str
    files: list[tuple[str, bytes]]  # (filename, content)
    output_modalities: list[str]
    model_kwargs: dict
    reference: VoiceClip | None = None
    stream: bool = False  # the client reads the output as it comes (``streaming``)
    session: SessionSpec | None = None  # the world-state session it continues or starts
    live_input: bool = False  # its input keeps coming by appends to its client stream (/generate/ws)


@dataclass
class OutputEvent:
    """A piece of a request's output as it streams out.

    ``text`` is the newly decoded text of this event (a delta). The last event of a
    request has ``finish_reason`` set ("stop", "length", "cancelled" or "error").
    ``data`` carries non-text payloads (audio, image bytes) with ``modality``. An event
    with ``error`` ends the request; ``error_status`` is the HTTP status that error maps to
    (504 timed out, 503 a worker died, a 4xx when an engine found the client's mistake, then
    ``error_field`` names the request's field; None: 500). An event of modality "progress" says how
    far a long step (denoising) has come: ``progress = (k, n)``, step k of n done.
    """

    modality: str = "text"
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    data: bytes | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_status: int | None = None
    error_field: str | None = None
    progress: tuple[int, int] | None = None


@dataclass(frozen=True)
class TranscriptionSpec:
    """One speech-to-text request (/v1/audio/transcriptions, /v1/audio/translations)."""

    request_id: str
    audio: bytes  # the uploaded file, undecoded
    filename: str
    task: str = "transcribe"  # or "translate" (to English)
    language: str | None = None  # ISO-639-1 code; None: detect
    prompt: str | None = None  # initial context for the decoder
    temperature: float | None = None  # None: greedy with temperature fallback
    model_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TranscriptionSegment:
    id: int
    start: float  # seconds
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str  # ISO-639-1 code
    duration: float  # seconds of audio
    segments: list[TranscriptionSegment] = field(default_factory=list)


@dataclass(frozen=True)
class SpeechSpec:
    """One text-to-speech request (/v1/audio/speech). ``reference``: a clip to clone the voice
    of (only for a model that clones). ``sentence_chunking``: speak the text as ordered
    sentence pieces (True), whole where the model allows (False), or as the model prefers
    (None)."""

    request_id: str
    input: str
    voice: str | None = None  # None: the model's default voice
    speed: float = 1.0
    model_kwargs: dict = field(default_factory=dict)  # temperature, top_p, repetition_penalty, seed, max_tokens
    reference: VoiceClip | None = None
    sentence_chunking: bool | None = None
    stream: bool = False  # the client plays the audio as it comes (``stream: true``)


@dataclass(frozen=True)
class ImageSpec:
    """One image request (/v1/images/generations, /v1/images/edits, /generate)."""

    request_id: str
    prompt: str
    width: int = 1024
    height: int = 1024
    n: int = 1
    seed: int | None = None
    num_inference_steps: int | None = None  # None: the model's default
    guidance_scale: float | None = None
    images: list[bytes] = field(default_factory=list)  # reference images to edit from, undecoded
    model_kwargs: dict = field(default_factory=dict)
