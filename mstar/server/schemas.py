"""Wire formats of the HTTP API: OpenAI chat completions, model list, errors, /generate.

Requests are validated here (ranges, supported options); a violation becomes a pydantic
``ValidationError`` whose ``loc`` is the offending field, which the app turns into a 400
naming that field. Validation that needs the model is the backend's (``RequestError``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from mstar.contract import ChatSpec, RequestError, SamplingParams, SessionSpec

# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


MEDIA_PART_TYPES = {"image_url": "image", "video_url": "video", "input_audio": "audio"}  # part type -> modality
InputAudioFormat = Literal["wav", "mp3", "flac", "ogg"]  # what an ``input_audio`` part may hold (libsndfile reads)


class MediaURL(BaseModel):
    """Where a content part's image or video is: a data URI or base64 (always), an http(s)
    URL only when the server sets MSTAR_ALLOW_REMOTE=1; paths on the server are refused."""

    model_config = ConfigDict(extra="ignore")

    url: str = Field(min_length=1, description="data:<type>;base64,<data>, bare base64, or an http(s) URL "
                                              "when the server sets MSTAR_ALLOW_REMOTE=1")
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="accepted for OpenAI compatibility; the model's processor picks the resolution")


class InputAudio(BaseModel):
    """An ``input_audio`` part's clip: the file itself, base64 (OpenAI's shape)."""

    model_config = ConfigDict(extra="ignore")

    data: str = Field(min_length=1, description="the audio file, base64 (a data URI is taken too)")
    format: InputAudioFormat = Field(description="the file's container: OpenAI's wav and mp3, and flac and ogg")


class ContentPart(BaseModel):
    """One part of a message's content; the field named like its ``type`` is required."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "image_url", "video_url", "input_audio"]
    text: str | None = None
    image_url: MediaURL | None = None
    video_url: MediaURL | None = None
    input_audio: InputAudio | None = None

    @model_validator(mode="after")
    def _has_its_field(self) -> ContentPart:
        if getattr(self, self.type) is None:
            error = PydanticCustomError("missing", "a part of type '{kind}' needs its '{kind}' field",
                                        {"kind": self.type})
            raise ValidationError.from_exception_data(
                "ContentPart", [InitErrorDetails(type=error, loc=(self.type,), input=None)])
        return self

    @property
    def modality(self) -> str | None:
        """What a media part holds (``image``, ``video``, ``audio``); None for a text part."""
        return MEDIA_PART_TYPES.get(self.type)


_CONTENT_PARTS = TypeAdapter(list[ContentPart])


class ChatMessage(BaseModel):
    """One message: ``content`` is a string or a list of parts (text, image_url, video_url,
    input_audio)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] = ""

    @field_validator("content", mode="wrap")
    @classmethod
    def _string_or_parts(cls, value: Any, _: Any) -> str | list[ContentPart]:
        """Validated here rather than as a union, so that an error names the part
        (``messages[0].content[1].type``), not a union branch: pydantic roots the parts'
        ValidationError at this field."""
        if value is None:  # e.g. an assistant turn that only carried tool calls
            return ""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise PydanticCustomError("content_type", "content must be a string or a list of content parts")
        return _CONTENT_PARTS.validate_python(value)

    @property
    def text(self) -> str:
        """The text parts joined by newlines (the content itself when it is a string)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content if part.type == "text")


class ChatTemplateKwargs(BaseModel):
    """vLLM's ``chat_template_kwargs``: only ``enable_thinking`` is read; other keys are ignored."""

    model_config = ConfigDict(extra="ignore")

    enable_thinking: bool | None = None


def _unsupported_unless_zero(value: float | None, name: str) -> float | None:
    if value not in (None, 0, 0.0):
        raise PydanticCustomError(
            "unsupported", "{name} is not supported (only 0 is accepted)", {"name": name}
        )
    return value


class SamplingRequest(BaseModel):
    """What OpenAI's chat and text completion bodies share: the model, the sampling fields
    (with vLLM's ``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos``), ``stop``,
    ``n`` and streaming. Unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension: -1 or 0 disables
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    stop: list[str] | None = Field(None, max_length=4)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    user: str | None = None  # accepted and ignored

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise PydanticCustomError("unsupported", "only n=1 is supported")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("presence_penalty")
    @classmethod
    def _no_presence_penalty(cls, value: float | None) -> float | None:
        return _unsupported_unless_zero(value, "presence_penalty")

    @field_validator("frequency_penalty")
    @classmethod
    def _no_frequency_penalty(cls, value: float | None) -> float | None:
        return _unsupported_unless_zero(value, "frequency_penalty")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self) -> SamplingParams:
        """OpenAI defaults (temperature 1, top_p 1) for whatever the request left out."""
        top_k = self.top_k if self.top_k is not None else 0
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(top_k, 0),
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            seed=self.seed,
        )


OutputAudioFormat = Literal["wav", "mp3", "flac", "opus", "pcm16", "aac"]  # OpenAI's; the route says which encode


class AudioOptions(BaseModel):
    """OpenAI's ``audio`` of a chat request: how a spoken answer (``modalities`` with
    ``audio``) sounds and is packed. A custom voice may come as ``{"id": ...}``."""

    model_config = ConfigDict(extra="ignore")

    voice: str = Field(min_length=1, description="one of the model's voices (/v1/audio/voices)")
    format: OutputAudioFormat = Field(description="the whole answer's container; streamed deltas are always pcm16")

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, value: Any) -> Any:
        return voice_id(value)


def _refusal(kind: str, message: str, loc: tuple[str, ...], model: str) -> ValidationError:
    """A ValidationError at ``loc`` (a model validator's own errors are rooted at the model)."""
    return ValidationError.from_exception_data(
        model, [InitErrorDetails(type=PydanticCustomError(kind, message), loc=loc, input=None)])


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = Field(
        None, description='what the answer is made of: ["text"] (the default) or ["text", "audio"]')
    audio: AudioOptions | None = Field(None, description='the spoken answer\'s voice and format; needed with '
                                                         '"audio" in modalities')
    max_completion_tokens: int | None = Field(None, ge=1)
    enable_thinking: bool | None = Field(
        None, description="extension: the chat template's thinking switch (None: the template's default)")
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description="extension (vLLM's): only enable_thinking is read; the top-level field wins")

    @model_validator(mode="after")
    def _audio_when_spoken(self) -> ChatCompletionRequest:
        outputs = set(self.modalities or ["text"])
        if outputs not in ({"text"}, {"text", "audio"}):
            raise _refusal("unsupported", 'must be ["text"] or ["text", "audio"]', ("modalities",),
                           "ChatCompletionRequest")
        if "audio" in outputs and self.audio is None:
            raise _refusal("missing", 'an "audio" object ({"voice", "format"}) is needed when modalities '
                                      'hold "audio"', ("audio",), "ChatCompletionRequest")
        return self

    @property
    def output_modalities(self) -> list[str]:
        """``modalities`` in a fixed order, text first; ``["text"]`` when left out."""
        outputs = set(self.modalities or ["text"])
        return [m for m in ("text", "audio") if m in outputs]

    @property
    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the legacy ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def thinking(self) -> bool | None:
        if self.enable_thinking is not None or self.chat_template_kwargs is None:
            return self.enable_thinking
        return self.chat_template_kwargs.enable_thinking

    def media_parts(self) -> list[tuple[str, ContentPart]]:
        """``(field, part)`` of every image, video and audio part, in prompt order; ``field``
        names the part (``messages[i].content[j]``)."""
        found = []
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if part.modality is not None:
                    found.append((f"messages[{i}].content[{j}]", part))
        return found

    def to_spec(self, request_id: str, media: list[bytes] | None = None) -> ChatSpec:
        """``media`` None: every content as one string (text parts joined), for a text-only
        model. Otherwise the bytes of ``media_parts()`` in order: list contents become the
        model's parts ``{"type": "text", "text"}`` / ``{"type": "image" | "video" | "audio",
        "data"}``."""
        fetched = iter(media or [])

        def content(message: ChatMessage) -> str | list[dict]:
            if media is None or isinstance(message.content, str):
                return message.text
            return [{"type": "text", "text": part.text} if part.modality is None
                    else {"type": part.modality, "data": next(fetched)} for part in message.content]

        return ChatSpec(
            request_id=request_id,
            messages=[{"role": m.role, "content": content(m)} for m in self.messages],
            sampling=self.sampling_params(),
            max_tokens=self.effective_max_tokens,
            stop=list(self.stop or []),
            ignore_eos=self.ignore_eos,
            enable_thinking=self.thinking,
            output_modalities=self.output_modalities,
            audio=self.audio.model_dump() if self.audio is not None and "audio" in self.output_modalities else None,
        )


# -------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


def _is_none(value: Any) -> bool:
    return value is None


class AudioAnswer(BaseModel):
    """A spoken answer (``message.audio``): the whole clip in the requested format, base64,
    and what it says. Nothing is kept on the server: ``expires_at`` is the time of the answer."""

    id: str
    data: str
    expires_at: int
    transcript: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is spoken (its words are the audio's transcript)
    audio: AudioAnswer | None = Field(None, exclude_if=_is_none)


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[Choice]
    usage: Usage


class DeltaAudio(BaseModel):
    """A piece of a streamed spoken answer: PCM16 (base64) or transcript text; the first
    piece carries the answer's ``id``, the last only ``expires_at``."""

    id: str | None = Field(None, exclude_if=_is_none)
    data: str | None = Field(None, exclude_if=_is_none)
    transcript: str | None = Field(None, exclude_if=_is_none)
    expires_at: int | None = Field(None, exclude_if=_is_none)


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_is_none)
    content: str | None = Field(None, exclude_if=_is_none)
    audio: DeltaAudio | None = Field(None, exclude_if=_is_none)


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_is_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "mstar"
    max_model_len: int | None = None
    # M* extra: what the model serves, of ``mstar.contract.TASKS`` (the playground shows a
    # panel per task; a client can tell which routes answer without trying them)
    tasks: list[str] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ------------------------------------------------------------------- /generate form


def parse_output_modalities(raw: str | None, default: tuple[str, ...] = ("text",)) -> list[str]:
    """A JSON list (``["text","audio"]``) or a comma list (``text,audio``); left out, ``default``
    (the served model's ``default_generate_outputs``; text)."""
    if raw is None or not raw.strip():
        return list(default)
    raw = raw.strip()
    if raw.startswith("["):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RequestError("output_modalities", f"invalid JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise RequestError("output_modalities", "must be a list of strings")
        names = [v.strip() for v in value]
    else:
        names = [v.strip() for v in raw.split(",")]
    names = [n for n in names if n]
    if not names:
        raise RequestError("output_modalities", "must name at least one modality")
    return list(dict.fromkeys(names))  # dedupe, keep order


def parse_model_kwargs(raw: str | None) -> dict:
    """A JSON object string; empty means ``{}``."""
    if raw is None or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError("model_kwargs", f"invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RequestError("model_kwargs", "must be a JSON object")
    return value


class SessionFields(BaseModel):
    """The world-state session fields a request may carry (``/generate``, the video routes)."""

    session_id: str | None = Field(
        None, min_length=1, max_length=128,
        description="names a world-state session: the model's nodes keep its state between requests")
    resume_session: bool = Field(False, description="continue the named session's state (410 if it is gone)")
    end_session: bool = Field(False, description="drop the named session's state once this request is done")
    session_timeout_s: float = Field(
        600.0, gt=0, description="seconds the idle session is kept, capped at the deployment's session_timeout_max_s")

    def session(self) -> SessionSpec | None:
        """The request's session, None without ``session_id`` (``resume_session`` or
        ``end_session`` without one is a ``RequestError`` naming it)."""
        if self.session_id is None:
            for name in ("resume_session", "end_session"):
                if getattr(self, name):
                    raise RequestError(name, "needs session_id")
            return None
        return SessionSpec(self.session_id, self.resume_session, self.end_session, self.session_timeout_s)


class GenerateForm(SessionFields):
    """The text fields of ``POST /generate`` (a multipart or urlencoded form). Files come as
    ``files`` parts; ``media`` names more inputs by reference (resolved by
    ``mstar.media.fetch``), appended to the files in order."""

    model_config = ConfigDict(extra="ignore")

    text: str = Field("", description="the prompt (or the text to speak, ...)")
    output_modalities: str | None = Field(
        None, description='modalities to produce: a JSON list (["text","audio"]) or a comma list; default text')
    streaming: bool = Field(False, description="stream NDJSON events instead of one JSON result")
    model_kwargs: str | None = Field(None, description="a JSON object of per-model knobs")
    media: list[str] = Field(
        default_factory=list,
        description="inputs by reference: a data URI or base64; an http(s) URL only when the server "
                    "sets MSTAR_ALLOW_REMOTE=1; paths on the server are refused")


class TranscriptionForm(BaseModel):
    """The text fields of ``POST /v1/audio/transcriptions`` and ``/translations`` (OpenAI's
    multipart form; the audio is the ``file`` part). Published in the OpenAPI document;
    the route checks each field with its own messages."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    language: str | None = Field(None, description="ISO-639-1 code or language name (transcriptions only)")
    prompt: str | None = None
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] = "json"
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    timestamp_granularities: list[Literal["segment"]] | None = Field(
        None, alias="timestamp_granularities[]", description="only 'segment' timestamps are available")
    model_kwargs: str | None = Field(None, description="a JSON object of per-model knobs")


# ------------------------------------------------------------------ OpenAPI bodies


def _inline_refs(schema: Any, defs: dict[str, Any]) -> Any:
    """``schema`` with every ``{"$ref": "#/$defs/X"}`` replaced by X itself (the OpenAPI
    document has no ``$defs`` for a schema given in ``openapi_extra``)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(v, defs) for v in schema]
    return schema


def _schema_of(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)
    return _inline_refs(schema, schema.get("$defs", {}))


def json_body_openapi(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that validates its JSON body with ``model`` by hand."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _schema_of(model)}}}}


def form_body_openapi(model: type[BaseModel], files: dict[str, bool], required_files: tuple[str, ...] = (),
                      urlencoded: bool = False) -> dict[str, Any]:
    """``openapi_extra`` for a route that parses a multipart form by hand: ``model``'s
    fields plus file parts (``files``: part name -> whether it may repeat)."""
    schema = _schema_of(model)
    properties = dict(schema.get("properties", {}))
    for name, many in files.items():
        binary = {"type": "string", "format": "binary"}
        properties[name] = {"type": "array", "items": binary} if many else binary
    body = {"type": "object", "properties": properties,
            "required": [*schema.get("required", []), *required_files]}
    content = {"multipart/form-data": {"schema": body}}
    if urlencoded:  # the same text fields, no files
        content["application/x-www-form-urlencoded"] = {"schema": {**body, "properties": schema.get("properties", {})}}
    return {"requestBody": {"required": True, "content": content}}


def voice_id(value: Any) -> Any:
    """A voice as OpenAI takes it: a name, or a custom voice as ``{"id": ...}`` (its id)."""
    if isinstance(value, dict) and isinstance(value.get("id"), str):
        return value["id"]
    return value
