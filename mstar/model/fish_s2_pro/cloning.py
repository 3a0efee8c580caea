"""A reference clip and its transcript to S2's in-prompt reference (what a cloning request's
``ref_audio`` and ``ref_text`` become).

fish-speech clones only from a clip *with* its transcript (``generate_long`` uses the prompt
when both are present), so a clip without ``ref_text`` is refused, naming it. The clip, mono
float32 at its own rate, is resampled to the codec's rate and encoded to frames.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.audio.io import resample
from mstar.contract import RequestError
from mstar.model.fish_s2_pro.codec_encoder import CodecEncoder
from mstar.model.fish_s2_pro.prompt import Reference

MAX_CLIP_SECONDS = 30.0


def encode_clip(encoder: CodecEncoder, samples: np.ndarray, sample_rate: int) -> torch.Tensor:
    """A clip's codes ``[N, frames]`` (on the CPU): ``samples`` (mono float32 at ``sample_rate``)
    resampled to the codec's rate and encoded. A function of the waveform and its rate alone,
    so a cache may key it by the decoded audio."""
    if samples.size == 0:
        raise RequestError("ref_audio", "the reference clip is empty")
    if samples.size / sample_rate > MAX_CLIP_SECONDS:
        raise RequestError("ref_audio", f"the reference clip is {samples.size / sample_rate:.1f} s; "
                                        f"the limit is {MAX_CLIP_SECONDS:g} s")
    rate = encoder.codec.sample_rate
    clip = torch.from_numpy(resample(np.asarray(samples, dtype=np.float32), sample_rate, rate))
    param = next(encoder.parameters())
    with torch.no_grad():
        return encoder(clip[None].to(param.device, param.dtype))[0].cpu()


def check_transcript(ref_text: str | None) -> str:
    """The clip's transcript, stripped; a missing or blank one is a 400 naming ``ref_text``."""
    if not ref_text or not ref_text.strip():
        raise RequestError("ref_text", "S2-Pro clones from a reference clip with its transcript; send ref_text")
    return ref_text.strip()


def clip_reference(encoder: CodecEncoder, samples: np.ndarray, sample_rate: int, ref_text: str | None) -> Reference:
    """The in-prompt reference of a clip and its transcript (required)."""
    return Reference(check_transcript(ref_text), encode_clip(encoder, samples, sample_rate))
