"""How the released NemotronVoiceChat checkpoint's EarTTS tensors map onto ``EarTTS``.

The VoiceChat safetensors keep the speech side under ``tts_model.``: the talker under
``tts_model.tts_model.`` (names as ours, ``rvq_embs`` included), the codec under
``tts_model.audio_codec.`` (``decoder.*`` and ``prvq.mus_list.*`` are loaded; its encoder
and the quantizer's EMA variances serve only training and prompt encoding), the cached
speaker latents under ``tts_model.audio_prompt_latents.<name>`` and the silence frame
``tts_model.codec_silence_tokens``. Not loaded: the character-aware text encoder
(``tts_model.tts_model.embed_subword.*``: its per-token output is a precomputed table, see
``TextTable``), the rest of ``tts_model.`` (``_control_codes``) and every other node's
weights (``stt_model.*``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from mstar.model.eartts.codec import CodecDecoder
from mstar.model.eartts.config import EarTTSConfig
from mstar.model.eartts.talker import EarTTSTalker

TALKER = "tts_model.tts_model."
CODEC = "tts_model.audio_codec."
SPEAKERS = "tts_model.audio_prompt_latents."
SILENCE = "tts_model.codec_silence_tokens"
SKIPPED = (TALKER + "embed_subword.", CODEC + "encoder.", CODEC + "prvq._variance_list.")


class EarTTS(nn.Module):
    """The talker and the codec decoder, with the checkpoint's speaker latents and silence
    frame beside them."""

    def __init__(self, config: EarTTSConfig, text_vocab: int = 1) -> None:
        super().__init__()
        self.config = config
        self.talker = EarTTSTalker(config.talker, text_vocab)
        self.codec = CodecDecoder(config.codec)
        self.speakers: dict[str, torch.Tensor] = {}
        self.register_buffer("silence_codes", torch.zeros(config.codec.num_quantizers, dtype=torch.long),
                             persistent=False)


def checkpoint_name(name: str) -> str | None:
    """Our name for checkpoint tensor ``name`` (None: not loaded as a weight)."""
    if name.startswith(SKIPPED) or not name.startswith("tts_model."):
        return None
    if name.startswith(TALKER):
        return "talker." + name[len(TALKER):]
    if name.startswith(CODEC):
        return "codec." + name[len(CODEC):]
    return None


@dataclass
class Extras:
    """The checkpoint's non-weight tensors the engine uses."""

    speakers: dict[str, torch.Tensor] = field(default_factory=dict)
    silence: torch.Tensor | None = None


def load_checkpoint(model: EarTTS, tensors: Iterable[tuple[str, torch.Tensor]],
                    dtype: torch.dtype | None = None) -> Extras:
    """Load ``tensors`` into ``model``, coverage checked both ways (``WeightLoadError``
    names a parameter nothing fills or a ``tts_model.`` tensor that fills nothing)."""
    from mstar.model.weights import load_weights

    extras = Extras()

    def keep(items: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in items:
            if name.startswith(SPEAKERS):
                extras.speakers[name[len(SPEAKERS):]] = tensor
            elif name == SILENCE:
                extras.silence = tensor.long()
            else:
                yield name, tensor

    load_weights(model, keep(tensors), name_map=checkpoint_name, dtype=dtype)
    model.speakers = {k: v.to(model.talker.bos_emb.dtype) for k, v in extras.speakers.items()}
    if extras.silence is not None:
        model.silence_codes.copy_(extras.silence)
    return extras
