"""Tiny checkpoints in the diffusers repository layout for the diffusion families' tests:
seeded random weights larger than the default init (so every path moves the output), and
the folders (transformer/, vae/, text_encoder/, tokenizer/, scheduler/, model_index.json)
written from the reference modules."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def randomize(module: torch.nn.Module, seed: int, *, spread: float = 0.2, weight_gain: float = 1.2,
              gains: tuple[str, ...] = (), offsets: tuple[str, ...] = ()) -> None:
    """1-D ``norm`` parameters and any named in ``gains`` become ``1 + spread * noise``; other
    1-D ones and any named in ``offsets`` ``spread * noise``; matrices and kernels noise
    scaled by ``weight_gain / sqrt(fan_in)``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 0:  # a scalar constant (LTX-2's decoder time multiplier) keeps its value
                continue
            if p.ndim == 1 and "norm" in name or any(g in name for g in gains):
                p.copy_(1.0 + spread * noise)
            elif p.ndim == 1 or any(o in name for o in offsets):
                p.copy_(spread * noise)
            else:
                p.copy_(noise * weight_gain / math.sqrt(p[0].numel()))


def write_diffusers_dir(root: Path, *, transformer: Any, vae: Any, text_encoder: Any, tokenizer: Any,
                        scheduler: dict[str, Any], model_index: dict[str, Any]) -> None:
    """The repository layout under ``root``, from diffusers models (``config`` + state dict),
    a transformers encoder and tokenizer (``save_pretrained``) and the two JSON files."""
    tokenizer.save_pretrained(root / "tokenizer")
    for folder, module in (("transformer", transformer), ("vae", vae)):
        (root / folder).mkdir()
        (root / folder / "config.json").write_text(json.dumps(dict(module.config), default=list))
        save_file({k: v.contiguous() for k, v in module.state_dict().items()},
                  root / folder / "diffusion_pytorch_model.safetensors")
    text_encoder.save_pretrained(root / "text_encoder")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    (root / "model_index.json").write_text(json.dumps(model_index))


def make_t5_tokenizer():
    """A unigram T5 tokenizer: letters, a few words, ``<pad>`` 0 and ``</s>`` 1 like UMT5's."""
    from transformers import T5TokenizerFast

    words = ["▁a", "▁cat", "▁dog", "▁walks", "▁on", "▁the", "▁moon", "▁sunlit", "▁floor"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(c, -5.0 - i / 10) for i, c in enumerate("▁abcdefghijklmnopqrstuvwxyz,.")] + [(w, -1.0) for w in words]
    return T5TokenizerFast(vocab=vocab, extra_ids=0)
