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

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from mstar.engine.sampling_params import SamplingParams
from mstar.server.backend import ChatSpec, RequestError

# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatMessage(BaseModel):
    """One message; ``content`` is normalized to a plain string (text parts joined)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> str:
        if value is None:  # e.g. an assistant turn that only carried tool calls
            return ""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise PydanticCustomError(
                "content_type", "content must be a string or a list of content parts"
            )
        texts: list[str] = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise PydanticCustomError(
                    "content_part",
                    "content part {index} has type {kind}: only 'text' parts are supported",
                    {"index": i, "kind": repr(kind)},
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise PydanticCustomError(
                    "content_part", "content part {index} needs a string 'text'", {"index": i}
                )
            texts.append(text)
        return "\n".join(texts)


def _unsupported_unless_zero(value: float | None, name: str) -> float | None:
    if value not in (None, 0, 0.0):
        raise PydanticCustomError(
            "unsupported", "{name} is not supported (only 0 is accepted)", {"name": name}
        )
    return value


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` body. Unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension: -1 or 0 disables
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
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

    @property
    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the legacy ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

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

    def to_spec(self, request_id: str) -> ChatSpec:
        return ChatSpec(
            request_id=request_id,
            messages=[{"role": m.role, "content": m.content} for m in self.messages],
            sampling=self.sampling_params(),
            max_tokens=self.effective_max_tokens,
            stop=list(self.stop or []),
            ignore_eos=self.ignore_eos,
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


def _is_none(value: Any) -> bool:
    return value is None


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_is_none)
    content: str | None = Field(None, exclude_if=_is_none)


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


def parse_output_modalities(raw: str | None) -> list[str]:
    """A JSON list (``["text","audio"]``) or a comma list (``text,audio``); default text."""
    if raw is None or not raw.strip():
        return ["text"]
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
