"""The reference package, k2-fsa's ``omnivoice`` 0.2.1, imported beside our torch/transformers.

It is installed without its dependencies into a private folder (it pins torch 2.8 and wants
torchaudio, pydub and soundfile, which this venv lacks)::

    pip install omnivoice==0.2.1 --no-deps --target scratch/omnivoice-0.2.1

``MSTAR_OMNIVOICE_REF`` names another folder. Only the model file's maths is exercised; the
audio I/O modules it imports at load time are stood in for by empty modules when missing (they
are never called here). Tests that need it skip, saying how to install it, when it is absent.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import types
from pathlib import Path

import pytest

VERSION = "0.2.1"
ROOT = Path(__file__).resolve().parents[3]
FOLDER = Path(os.environ.get("MSTAR_OMNIVOICE_REF", ROOT / "scratch" / f"omnivoice-{VERSION}"))

_STUBS = {
    "torchaudio": {},
    "soundfile": {},
    "pydub": {"AudioSegment": None},
    "pydub.silence": dict.fromkeys(("detect_leading_silence", "detect_nonsilent", "split_on_silence")),
}


def _stand_in(name: str, attrs: dict) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__dict__.update(attrs)
        sys.modules[name] = module


def stand_in_audio_io() -> None:
    """Empty modules for the audio I/O packages this venv lacks (torchaudio: transformers'
    Higgs Audio v2 tokenizer module imports it but decodes without it)."""
    for name, attrs in _STUBS.items():
        _stand_in(name, attrs)
    # transformers caches whether torchaudio is installed; a test collected earlier may have
    # asked before the stand-in existed.
    from transformers.utils import import_utils

    for probe in ("is_torchaudio_available", "is_speech_available"):
        getattr(getattr(import_utils, probe, None), "cache_clear", lambda: None)()


def reference():
    """``omnivoice.models.omnivoice`` from the private install (skips the test without it)."""
    if not (FOLDER / "omnivoice").is_dir():
        pytest.skip(f"omnivoice {VERSION} not found at {FOLDER}: pip install omnivoice=={VERSION} "
                    f"--no-deps --target {FOLDER}")
    if str(FOLDER) not in sys.path:
        sys.path.insert(0, str(FOLDER))
    stand_in_audio_io()
    from importlib.metadata import version

    module = importlib.import_module("omnivoice.models.omnivoice")
    found = version("omnivoice") if (FOLDER / f"omnivoice-{VERSION}.dist-info").is_dir() else None
    assert found in (None, VERSION), found
    return module


class CharTokenizer:
    """A stand-in text tokenizer: one id per character (the reference only calls it and reads
    ``input_ids``; the real one is Qwen's BPE with OmniVoice's control tokens)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, text: str, return_tensors: str | None = None, add_special_tokens: bool = True):
        import torch

        ids = [ord(ch) % (self.vocab_size - 1) + 1 for ch in text]
        return types.SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)


def hf_codec_config(codec):
    """transformers' ``HiggsAudioV2TokenizerConfig`` for our ``CodecConfig``."""
    from transformers import HiggsAudioV2TokenizerConfig

    return HiggsAudioV2TokenizerConfig(
        sample_rate=codec.sample_rate, codebook_size=codec.codebook_size, codebook_dim=codec.codebook_dim,
        target_bandwidths=list(codec.target_bandwidths), semantic_sample_rate=codec.semantic_sample_rate,
        downsample_factor=codec.downsample_factor,
        acoustic_model_config=dict(model_type="dac", encoder_hidden_size=codec.encoder_hidden_size,
                                   hidden_size=codec.acoustic_hidden_size,
                                   downsampling_ratios=list(codec.downsampling_ratios),
                                   upsampling_ratios=list(codec.upsampling_ratios),
                                   decoder_hidden_size=codec.decoder_hidden_size),
        semantic_model_config=dict(codec.semantic))
