"""A Cosmos3 generation prompt as the pipeline renders it (diffusers' ``tokenize_prompt``): the
prompt with the clip's metadata appended ("The video is 5.0 seconds long and is of 24 FPS.",
"This video is of 720x1280 resolution."), the negative prompt with the inverse sentences ("is
not ..."), each as a chat (a mode-specific system prompt, the user turn, the assistant's
opening), then the end-of-text and ``<|vision_start|>`` ids that open the media."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SYSTEM = {"image": "You are a helpful assistant who will generate images from a give prompt.",
          "video": "You are a helpful assistant who will generate videos from a give prompt."}


def _append(base: str, addition: str) -> str:
    base = base.rstrip(".")
    return f"{base}. {addition}" if base else addition


def with_metadata(text: str, *, num_frames: int, height: int, width: int, fps: float, negative: bool) -> str:
    """``text`` with the duration (video only) and resolution sentences, negated for a negative
    prompt."""
    nt = " not" if negative else ""
    if num_frames > 1:
        text = _append(text, f"The video is{nt} {num_frames / fps:.1f} seconds long and is{nt} of {fps:.0f} FPS.")
    kind = "image" if num_frames == 1 else "video"
    return _append(text, f"This {kind} is{nt} of {height}x{width} resolution.")


@dataclass
class Cosmos3Prompt:
    tokenizer: Any
    use_system_prompt: bool = True

    @classmethod
    def from_directory(cls, root: Path, use_system_prompt: bool = True) -> Cosmos3Prompt:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(root / "text_tokenizer"), use_system_prompt)

    def ids(self, text: str, *, num_frames: int, height: int, width: int, fps: float,
            negative: bool = False) -> torch.Tensor:
        """The token ids ``[L]`` of a prompt (``negative``: of a negative prompt)."""
        content = with_metadata(text, num_frames=num_frames, height=height, width=width, fps=fps, negative=negative)
        return self.chat_ids(content, video=num_frames > 1)

    def chat_ids(self, content: str, *, video: bool = True) -> torch.Tensor:
        """The token ids ``[L]`` of ``content`` sent as it is (an action request's caption and
        negative prompt)."""
        turns = []
        if self.use_system_prompt:
            turns.append({"role": "system", "content": SYSTEM["video" if video else "image"]})
        turns.append({"role": "user", "content": content})
        ids = self.tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=True,
                                                 add_vision_id=False, return_dict=True)["input_ids"]
        start = self.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        return torch.tensor([*ids, self.tokenizer.eos_token_id, start], dtype=torch.long)
