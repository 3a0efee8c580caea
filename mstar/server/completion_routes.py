"""/v1/completions: OpenAI's legacy text completions, plain and SSE streaming, for the models
that serve ``text_completion`` (the LLM families). The prompt is continued as it is, with no
chat template: what serving benchmarks (vLLM's ``bench serve``, genai-perf) and base-model
clients send.

One prompt per request: a string, a list of one string, token ids, or a list of one list of
token ids; several prompts are refused with a 400 naming ``prompt`` (send them as separate
requests: the server batches concurrent requests anyway). ``n`` and ``best_of`` are 1;
``echo`` puts the prompt's text ahead of the completion (first in a stream); ``logprobs``
above 0, ``suffix`` and ``logit_bias`` are refused, naming the field (the engine returns no
log probabilities). vLLM's extras are taken: ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos`` and ``add_special_tokens`` (whether a string prompt gets the tokenizer's
special tokens, a BOS say; default true).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from mstar.contract import CompletionSpec, OutputEvent
from mstar.server.backend import CompletingBackend
from mstar.server.bodies import json_body
from mstar.server.errors import APIError, exception_response, in_band_error
from mstar.server.schemas import SamplingRequest, Usage, new_id, now
from mstar.server.served import backend_of, resolve_model
from mstar.server.streaming import (
    Events,
    Tally,
    collect_events,
    sse,
    start_events,
    stream_response,
    text_chunks,
    unless_disconnected,
    walk_events,
)

MAX_COMPLETION_BODY_BYTES = 16 * 1024 * 1024  # a prompt of text or token ids, as JSON
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions


def _unsupported(message: str, **context: Any) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message, context)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions`` body."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="one prompt: a string or token ids (a list holding one of them is taken too)")
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1, description="null: up to the context length")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, description="only 0 or null: the engine returns no log probabilities")
    suffix: str | None = Field(None, description="not supported (only null or empty)")
    best_of: int | None = Field(None, ge=1, description="only 1")
    logit_bias: dict[str, float] | None = Field(None, description="not supported (only null or empty)")
    add_special_tokens: bool = Field(
        True, description="extension (vLLM's): a string prompt gets the tokenizer's special tokens (a BOS)")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt(cls, value: Any, _: Any) -> str | list[int]:
        """One prompt, as a string or token ids. Checked here rather than as a union, so that
        an error names ``prompt`` (or the token at fault), not a union branch."""
        if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
            if len(value) > 1:
                raise _unsupported("one prompt per request ({count} given); send each as its own request "
                                   "(concurrent requests are batched)", count=len(value))
            value = value[0]
        if isinstance(value, str):
            if not value:
                raise PydanticCustomError("empty", "the prompt must not be empty")
            return value
        if not isinstance(value, list):
            raise PydanticCustomError("prompt_type", "the prompt must be a string or a list of token ids")
        if not value:
            raise PydanticCustomError("empty", "the prompt must not be empty")
        for i, token in enumerate(value):
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise PydanticCustomError("token_id", "token ids are integers of 0 or more; token {index} is {token}",
                                          {"index": i, "token": json.dumps(token)})
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise _unsupported("log probabilities are not available: the engine does not return them "
                               "(send null or 0)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("suffix is not supported (insertion needs a fill-in-the-middle model)")
        return value

    @field_validator("best_of")
    @classmethod
    def _only_best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise _unsupported("only best_of=1 is supported")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise _unsupported("logit_bias is not supported")
        return value

    def to_spec(self, request_id: str) -> CompletionSpec:
        assert isinstance(self.prompt, str) or all(isinstance(t, int) for t in self.prompt)  # _one_prompt's
        return CompletionSpec(
            request_id=request_id,
            prompt=self.prompt,  # type: ignore[arg-type]
            sampling=self.sampling_params(),
            max_tokens=self.max_tokens,
            stop=list(self.stop or []),
            ignore_eos=self.ignore_eos,
            echo=self.echo,
            add_special_tokens=self.add_special_tokens,
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A completion, and each chunk of a streamed one (choices ``[]`` and ``usage`` last)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=lambda usage: usage is None)  # a chunk's, but the last


async def completions(request: Request) -> Response:
    req = await json_body(request, CompletionRequest, max_bytes=MAX_COMPLETION_BODY_BYTES)
    model = resolve_model(request, req.model, "text_completion")
    backend = backend_of(request)
    completing = cast(CompletingBackend, backend)  # resolve_model checked that it serves text_completion
    if req.max_tokens is not None and req.max_tokens > backend.max_model_len:
        message = f"max_tokens: must be at most the context length ({backend.max_model_len})"
        raise APIError(400, message, "max_tokens", "invalid_value")

    request_id = new_id("cmpl")
    spec = req.to_spec(request_id)
    try:
        first, events = await start_events(lambda: completing.complete(spec), request)
    except Exception as exc:
        return exception_response(exc)
    if req.stream:
        return stream_response(_completion_sse(request_id, model, first, events, req.include_usage),
                               "text/event-stream")

    async def complete() -> Response:
        try:
            out = await collect_events(first, events)
        except Exception as exc:
            return exception_response(exc)
        choice = CompletionChoice(text="".join(out.text), finish_reason=out.finish_reason)
        return JSONResponse(Completion(id=request_id, model=model, choices=[choice], usage=out.usage()).model_dump())

    return await unless_disconnected(request, complete)


async def _completion_sse(
    request_id: str, model: str, first: OutputEvent | None, events: Events, include_usage: bool
) -> AsyncIterator[str]:
    """SSE chunks: text deltas (the echoed prompt first), the finish_reason, [usage], ``[DONE]``."""
    created = now()

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        body = Completion(id=request_id, created=created, model=model, choices=choices, usage=usage)
        return sse(body.model_dump())

    text = text_chunks(lambda delta: chunk([CompletionChoice(text=delta)]))
    tally = Tally()
    try:
        async with aclosing(walk_events(first, events, tally)) as walk:
            async for event in walk:
                if event.modality == "text" and event.text:
                    yield text(event.text)
        yield chunk([CompletionChoice(text="", finish_reason=tally.finish_reason or "stop")])
        if include_usage:
            yield chunk([], usage=tally.usage())
    except Exception as exc:  # the stream has started: report in band, then end it
        yield sse(in_band_error(exc))
    yield sse("[DONE]")
