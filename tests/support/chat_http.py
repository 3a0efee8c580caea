"""Helpers of the served multimodal-chat tests (tests/e2e/test_qwen3_5_http.py,
test_bagel_served.py): content parts as the OpenAI API writes them, a greedy question, and
the check that concurrent requests answer as they do alone."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import openai
from PIL import Image


def png_uri(seed: int, size: tuple[int, int]) -> str:
    """A random ``size = (width, height)`` PNG as a data URI."""
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def ask(oai: openai.OpenAI, model: str, content: list[dict] | str, max_tokens: int, **extra: object) -> Any:
    """One user turn, greedy, exactly ``max_tokens`` tokens (``ignore_eos``)."""
    return oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, **extra})


def check_concurrent_equals_solo(oai: openai.OpenAI, model: str, contents: list, max_tokens: int,
                                 streamed: int = 0) -> None:
    """Each of ``contents`` asked alone (all answers distinct), then twice each at once: the same
    answers and prompt sizes; ``contents[streamed]`` streamed gives its solo text too."""
    def answer(content) -> tuple[str, int]:
        result = ask(oai, model, content, max_tokens)
        return result.choices[0].message.content, result.usage.prompt_tokens

    alone = [answer(c) for c in contents]
    assert len(set(alone)) == len(contents)
    with ThreadPoolExecutor(len(contents) * 2) as pool:
        together = list(pool.map(answer, contents * 2))
    assert together == alone * 2
    stream = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": contents[streamed]}],
                                         max_tokens=max_tokens, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == alone[streamed][0]


