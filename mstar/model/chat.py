"""What the chat LLM families share (Llama, Qwen3.5): the stop tokens, the chat template, the
options of ``/generate``, text completions (a raw prompt, no template) and the chat walk's
request.

A chat walk is a prefill, then a Loop of decodes until the engine raises ``stop`` or the
budget runs out; every sampled token streams to the client as text (``TextStream``). A
request's KV pages grow to those of its prompt plus its ``max_tokens`` (default: the rest of
``max_seq_len``) at most; it is admitted against its prompt's (``decode_request``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from pydantic import Field

from mstar.contract import ChatSpec, CompletionSpec, GenerateSpec, RequestError, SamplingParams
from mstar.model.decoding import SamplingKnobs, checked_sampling, decode_request
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.text_stream import TextStream


def split_content(messages: list[dict], kinds: Sequence[str], take: Callable[[str, dict, str], None]) -> list[dict]:
    """The messages as a chat template takes them: in list contents, text parts kept and each
    media part (``type`` in ``kinds``) handed to ``take(kind, part, where)`` in prompt order and
    left as ``{"type": kind}``; any other part type is a RequestError naming the part
    (``where``: ``messages[i].content[j]``), as ``take``'s refusals are."""
    template: list[dict] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            template.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
                continue
            if kind not in kinds:
                raise RequestError(where, f"unknown content part type {kind!r} (text, {', '.join(kinds[:-1])} or "
                                          f"{kinds[-1]})")
            take(kind, part, where)
            parts.append({"type": kind})
        template.append({**message, "content": parts})
    return template


class GenerateKnobs(SamplingKnobs):
    """``/generate``'s ``model_kwargs`` for a chat LLM."""

    max_tokens: int | None = Field(None, ge=1)
    """New tokens at most (default: the rest of ``max_seq_len``)."""

    chat: bool = True
    """Wrap the text in the chat template as a user message (false: the text is the prompt)."""

    stop: str | list[str] | None = None
    """Stop strings (the runtime cuts the text before the first one)."""


class ChatLLM(ModelSpec):
    """The chat side of an LLM family. A subclass loads ``tokenizer`` and ``stop_token_ids``
    in ``load_frontend`` and declares its graph with a ``chat`` walk (``chat_walk``)."""

    GenerateKnobs: ClassVar[type[GenerateKnobs]] = GenerateKnobs
    # Whether a chat holds its prompt + max_tokens KV pages from admission: for an engine that
    # cannot preempt its sequences (their state is not recomputed from the tokens alone).
    kv_upfront: ClassVar[bool] = False
    tokenizer: Any
    stop_token_ids: list[int]

    @property
    def chat_walk(self) -> str:
        """The walk a chat request takes."""
        return "chat"

    def stop_ids(self, eos: int | list[int] | None, *more: int) -> list[int]:
        """The ids that end a chat: the checkpoint's ``eos`` (one id or several), ``more`` and
        the tokenizer's own end-of-sequence id."""
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        ids.update(more)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    def chat_ids(self, messages: list[dict], **template) -> list[int]:
        """The prompt ids of ``messages`` under the chat template (``template``: its switches)."""
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                        **template)
        except Exception as err:
            raise RequestError("messages", f"cannot apply the chat template: {err}") from None
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def prepare_chat(self, spec: ChatSpec) -> WalkRequest:
        checked_sampling(spec.sampling)
        return self.text_request(self.chat_ids(spec.messages), spec.max_tokens, spec.sampling, spec.ignore_eos)

    def prepare_completion(self, spec: CompletionSpec) -> WalkRequest:
        """The chat walk over the prompt as it is (no template): a string tokenised, token ids
        checked against the vocabulary. With ``echo`` the prompt's text (token ids decoded)
        goes out ahead of the completion."""
        checked_sampling(spec.sampling)
        if isinstance(spec.prompt, str):
            ids = self.tokenizer.encode(spec.prompt, add_special_tokens=spec.add_special_tokens) if spec.prompt else []
        else:
            ids = list(spec.prompt)
            vocab = len(self.tokenizer)
            for i, token in enumerate(ids):
                if not 0 <= token < vocab:
                    raise RequestError(f"prompt[{i}]", f"token id {token} is outside the vocabulary (0..{vocab - 1})")
        if not ids:
            raise RequestError("prompt", "must not be empty")
        request = self.text_request(ids, spec.max_tokens, spec.sampling, spec.ignore_eos, prompt_field="prompt")
        if spec.echo:
            request.echo = spec.prompt if isinstance(spec.prompt, str) else self.tokenizer.decode(ids)
        return request

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if spec.files:
            raise RequestError("files", f"model {self.key!r} takes text only")
        if set(spec.output_modalities) - {"text"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs text only")
        if not spec.text:
            raise RequestError("text", "must not be empty")
        options = self.GenerateKnobs.parse(spec.model_kwargs)
        sampling = options.sampling()
        if options.chat:
            return self.prepare_chat(ChatSpec(spec.request_id, [{"role": "user", "content": spec.text}],
                                              sampling, options.max_tokens))
        ids = self.tokenizer.encode(spec.text, add_special_tokens=False)
        return self.text_request(ids, options.max_tokens, sampling, False)

    def text_request(self, ids: list[int], max_tokens: int | None, sampling: SamplingParams,
                     ignore_eos: bool, *, prompt_field: str = "messages") -> WalkRequest:
        """The chat walk over prompt ``ids``, its budget checked against ``max_seq_len`` (a
        prompt too long is the fault of ``prompt_field``)."""
        limit = self.config.max_seq_len
        room = limit - len(ids)
        if room < 1:
            raise RequestError(prompt_field, f"the prompt has {len(ids)} tokens; max_seq_len is {limit}")
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise RequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                             f"max_seq_len ({limit})")
        return decode_request(self.chat_walk, {"prompt_ids": torch.tensor(ids, dtype=torch.int64)}, len(ids),
                              max_tokens, sampling, [] if ignore_eos else self.stop_token_ids, self.config,
                              upfront=self.kv_upfront)

    def output_stream(self, request: WalkRequest, stop: list[str]) -> TextStream:
        return TextStream(self.tokenizer, stop)
