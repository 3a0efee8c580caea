"""The request side of a decode walk, shared by the autoregressive families (the chat LLMs,
the Orpheus talker, Whisper's decoder): a request's sampling options, checked, and the walk
request with its token budget and the KV pages it is admitted against.

Every decode walk carries the same parameters for its autoregressive engine: ``sampling``,
``max_new_tokens``, ``max_decode_steps`` (the Loop's bound: the prefill makes the first
token) and ``stop_token_ids``; a family adds its own beside them.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from mstar.config import ConfigError, DeploymentConfig
from mstar.contract import RequestError, SamplingParams
from mstar.engine.sampler import validate_sampling
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.knobs import RequestKnobs
from mstar.model.spec import WalkRequest

_DEFAULT = SamplingParams()


class SamplingKnobs(RequestKnobs):
    """The sampling options a request may send in its ``model_kwargs`` (``SamplingParams``'
    fields); their ranges are ``validate_sampling``'s."""

    temperature: float = _DEFAULT.temperature
    top_p: float = _DEFAULT.top_p
    top_k: int = _DEFAULT.top_k
    min_p: float = _DEFAULT.min_p
    repetition_penalty: float = _DEFAULT.repetition_penalty
    seed: int | None = _DEFAULT.seed

    def sampling(self, defaults: dict[str, Any] | None = None, *, field: str | None = None) -> SamplingParams:
        """What the request sent, over the family's ``defaults``, over ``SamplingParams``' own;
        checked (``checked_sampling``)."""
        sent = self.model_dump(include=set(SamplingParams.__struct_fields__), exclude_unset=True)
        return checked_sampling(SamplingParams(**{**(defaults or {}), **sent}), field=field)


def checked_sampling(params: SamplingParams, *, field: str | None = None) -> SamplingParams:
    """``params`` if usable; else a ``RequestError`` naming ``field`` (default: the sampling
    field at fault, as the OpenAI routes name it)."""
    try:
        validate_sampling(params)
    except ValueError as err:
        message = str(err)
        name = message.split(" ", 1)[0]  # validate_sampling starts each message with the field
        raise RequestError(field or (name if name in SamplingParams.__struct_fields__ else "sampling"),
                           message) from None
    return params


def kv_pages(tokens: int, config: DeploymentConfig) -> int:
    """KV pages that hold ``tokens`` positions."""
    return -(-tokens // config.resources.kv_cache.page_size)


def pool_for_every_request(config: DeploymentConfig, tokens: int, what: str) -> dict[str, int]:
    """The KV pool as a capacity, refused at startup (naming ``what`` the ``tokens`` are) unless
    every admitted request can hold ``tokens`` positions at once."""
    kv = config.resources.kv_cache
    each = kv_pages(tokens, config)
    need = each * config.max_concurrent_requests
    if kv.max_num_pages < need:
        raise ConfigError(f"resources.kv_cache.max_num_pages ({kv.max_num_pages}) cannot hold "
                          f"max_concurrent_requests ({config.max_concurrent_requests}) requests of up to "
                          f"{each} pages each ({what}): set it to at least {need} or lower max_concurrent_requests")
    return {"kv_pages": kv.max_num_pages}


def state_slots(config: DeploymentConfig, pool: str) -> int:
    """Slots of the recurrent-state pool ``resources.<pool>``, the sink included (default: one
    per admitted request, plus the sink)."""
    given = getattr(config.resources, pool)
    return given.max_slots if given is not None else config.max_concurrent_requests + 1


def state_capacity(config: DeploymentConfig, pool: str) -> int:
    """The requests ``resources.<pool>`` holds at once (its slots less the sink), refused at
    startup unless that is every admitted request (a ``ConfigError`` naming its ``max_slots``)."""
    from mstar.engine.state_pool import check_pool_holds

    slots = state_slots(config, pool)
    try:
        check_pool_holds(slots, config.max_concurrent_requests, f"resources.{pool}.max_slots")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return slots - 1


def decode_request(walk: str, inputs: dict[str, torch.Tensor], prompt_tokens: int, max_tokens: int,
                   sampling: SamplingParams | dict[str, Any], stop_token_ids: list[int], config: DeploymentConfig,
                   *, upfront: bool = False, **params: Any) -> WalkRequest:
    """A decode walk's request: ``prompt_tokens`` then at most ``max_tokens`` new ones, stopping
    at ``stop_token_ids``. ``params``: the family's own request parameters.

    It is admitted against its prompt's KV pages and one more (its first decodes); the engine
    reserves the rest as it grows, and preempts the newest sequences when the pool runs out.
    Its peak, the pages of prompt + ``max_tokens``, must fit the whole pool. ``upfront``: it
    holds that peak from admission instead (an engine that cannot preempt it)."""
    if isinstance(sampling, SamplingParams):
        sampling = msgspec.structs.asdict(sampling)
    params = {"sampling": sampling, "max_new_tokens": max_tokens, "max_decode_steps": max_tokens - 1,
              "stop_token_ids": stop_token_ids, **params}
    peak = kv_pages(prompt_tokens + max_tokens, config)
    admitted = peak if upfront else min(peak, kv_pages(prompt_tokens, config) + 1)
    return WalkRequest(walk, inputs, params, {"kv_pages": admitted}, prompt_tokens=prompt_tokens,
                       peak={"kv_pages": peak})


def transcribe_graph(scores: bool = False) -> Graph:
    """The graph of an audio encoder and an autoregressive text decoder (Whisper, Canary):
    the ``transcribe`` walk encodes ``mel`` once, prefills the decoder on the task prompt
    ``prompt_ids`` (cross-attending to the audio), then decodes until ``stop`` or
    ``max_decode_steps``; every token streams out as text. ``scores``: the decoder's last step
    also writes ``scores`` (Whisper's ``[avg_logprob, no_speech_prob]``), sent as they are."""
    written = ("token", "scores") if scores else ("token",)
    emit = (Emit("token", "text"), Emit("scores", "scores")) if scores else (Emit("token", "text"),)
    encoder = Node("encoder", "stateless", inputs=("mel",), outputs=("audio_features",))
    decoder = Node("decoder", "autoregressive", inputs=("prompt_ids", "audio_features", "token"),
                   outputs=written, ops=("prefill", "decode"), flags=("stop",))
    walk = Walk("transcribe", Sequential(
        Step("encoder", reads="mel", writes="audio_features"),
        Step("decoder", "prefill", reads=("prompt_ids", "audio_features"), writes=written, emit=emit),
        Loop(Step("decoder", "decode", reads="token", writes=written, emit=emit),
             until="stop", max_iters="max_decode_steps"),
    ), inputs=("mel", "prompt_ids"))
    return Graph.build([encoder, decoder], [walk])
