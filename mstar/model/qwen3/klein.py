"""Prompt conditioning of the Qwen3-conditioned diffusion pipelines, as diffusers computes it.

FLUX.2 klein (``Flux2KleinPipeline._get_qwen3_prompt_embeds`` / ``encode_prompt``):
  * each prompt becomes ``[{"role": "user", "content": prompt}]`` rendered by the tokenizer's
    chat template with ``add_generation_prompt=True, enable_thinking=False``; Qwen3's template
    renders ``<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n`` followed
    by an empty think block ``<think>\\n\\n</think>\\n\\n``;
  * tokenized with ``padding="max_length", truncation=True, max_length=512`` (tokenizer's
    padding side: right for Qwen's tokenizer, pad ``<|endoftext|>``);
  * the causal LM runs over all 512 positions with the padding mask; hidden states
    ``(9, 18, 27)`` (HF indices: outputs of layers 9, 18, 27, pre-norm) are concatenated on the
    channel axis, ``[B, 512, 3 * hidden]``; padding positions are KEPT (no mask reaches the
    transformer);
  * text ids ``[B, L, 4]`` (int64) are ``(t=0, h=0, w=0, l=position)``.

Z-Image (``ZImagePipeline._encode_prompt``), same Qwen3 family (Qwen3-4B):
  * chat template with ``add_generation_prompt=True, enable_thinking=True`` (Qwen3's template
    then adds nothing after ``<|im_start|>assistant\\n``);
  * ``padding="max_length", max_length=512, truncation=True``;
  * ``hidden_states[-2]`` (output of the penultimate layer, pre-norm), then per prompt only the
    real tokens (``embeds[i][mask[i]]``): a list of ``[n_i, hidden]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mstar.model.qwen3.encoder import Qwen3TextEncoder

KLEIN_TAP_LAYERS: tuple[int, ...] = (9, 18, 27)
KLEIN_MAX_LENGTH = 512
Z_IMAGE_TAP_LAYER = -2
Z_IMAGE_MAX_LENGTH = 512


def _as_list(prompts: str | Sequence[str]) -> list[str]:
    return [prompts] if isinstance(prompts, str) else list(prompts)


def _tokenize_chat(
    tokenizer: Any,
    prompts: list[str],
    max_length: int,
    enable_thinking: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Render each prompt as one user turn plus the generation prompt and pad to ``max_length``."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )
        for prompt in prompts
    ]
    batch = tokenizer(
        texts, return_tensors="pt", padding="max_length", truncation=True, max_length=max_length
    )
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


def text_ids(batch: int, length: int, device: torch.device | None = None) -> torch.Tensor:
    """FLUX.2 text position ids ``[B, L, 4]`` (int64): ``(t, h, w, l) = (0, 0, 0, position)``."""
    ids = torch.zeros(batch, length, 4, dtype=torch.int64, device=device)
    ids[..., 3] = torch.arange(length, device=device)
    return ids


@torch.no_grad()
def klein_prompt_embeds(
    encoder: Qwen3TextEncoder,
    tokenizer: Any,
    prompts: str | Sequence[str],
    max_length: int = KLEIN_MAX_LENGTH,
    tap_layers: Sequence[int] = KLEIN_TAP_LAYERS,
    num_images_per_prompt: int = 1,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_embeds [B*n, L, len(taps)*hidden], text_ids [B*n, L, 4])`` as
    ``Flux2KleinPipeline.encode_prompt`` returns them (each prompt repeated ``n`` times in a row).
    """
    device = encoder.model.embed_tokens.weight.device
    input_ids, mask = _tokenize_chat(
        tokenizer, _as_list(prompts), max_length, enable_thinking=False, device=device
    )
    states = encoder(input_ids, mask, tap_layers=tap_layers)
    # diffusers stacks to [B, taps, L, H] and permutes to [B, L, taps, H]: a channel concat.
    embeds = torch.cat(states, dim=-1)
    if dtype is not None:
        embeds = embeds.to(dtype)
    embeds = embeds.repeat_interleave(num_images_per_prompt, dim=0)
    return embeds, text_ids(embeds.shape[0], embeds.shape[1], device)


@torch.no_grad()
def z_image_caption_embeds(
    encoder: Qwen3TextEncoder,
    tokenizer: Any,
    prompts: str | Sequence[str],
    max_length: int = Z_IMAGE_MAX_LENGTH,
    tap_layer: int = Z_IMAGE_TAP_LAYER,
) -> list[torch.Tensor]:
    """Per-prompt caption features ``[n_i, hidden]`` (real tokens only) as
    ``ZImagePipeline._encode_prompt`` returns them."""
    device = encoder.model.embed_tokens.weight.device
    input_ids, mask = _tokenize_chat(
        tokenizer, _as_list(prompts), max_length, enable_thinking=True, device=device
    )
    (states,) = encoder(input_ids, mask, tap_layers=(tap_layer,))
    keep = mask.bool()
    return [states[i][keep[i]] for i in range(states.shape[0])]
