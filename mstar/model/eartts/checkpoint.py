"""How the released NemotronVoiceChat checkpoint's EarTTS tensors map onto ``EarTTS``.

The VoiceChat safetensors keep the speech side under ``tts_model.``: the talker under
``tts_model.tts_model.`` (names as ours, ``rvq_embs`` included), the codec under
``tts_model.audio_codec.`` (``decoder.*`` and ``prvq.mus_list.*`` are loaded; its encoder
and the quantizer's EMA variances serve only training and prompt encoding), the cached
speaker latents under ``tts_model.audio_prompt_latents.<name>`` and the silence frame
``tts_model.codec_silence_tokens``. The character-aware text encoder
(``tts_model.tts_model.embed_subword.*``) is loaded on its own and run once over the
tokenizer's vocabulary into the talker's ``TextTable`` (``text_encoder.py``), then dropped.
Not loaded: the rest of ``tts_model.`` (``_control_codes``) and every other node's weights
(``stt_model.*``).
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
TEXT_ENCODER = TALKER + "embed_subword."
SKIPPED = (CODEC + "encoder.", CODEC + "prvq._variance_list.")


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
    text_encoder: dict[str, torch.Tensor] = field(default_factory=dict)  # ``embed_subword.*``


def load_checkpoint(model: EarTTS, tensors: Iterable[tuple[str, torch.Tensor]],
                    dtype: torch.dtype | None = None, vocab: dict[str, int] | None = None) -> Extras:
    """Load ``tensors`` into ``model``, coverage checked both ways (``WeightLoadError``
    names a parameter nothing fills or a ``tts_model.`` tensor that fills nothing). With the
    text tokenizer's ``vocab``, the checkpoint's text encoder fills the talker's text table
    (without it, the encoder's tensors are returned in ``Extras.text_encoder``)."""
    from mstar.model.weights import load_weights

    extras = Extras()

    def keep(items: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in items:
            if name.startswith(TEXT_ENCODER):
                extras.text_encoder[name[len(TEXT_ENCODER):]] = tensor
            elif name.startswith(SPEAKERS):
                extras.speakers[name[len(SPEAKERS):]] = tensor
            elif name == SILENCE:
                extras.silence = tensor.long()
            else:
                yield name, tensor

    load_weights(model, keep(tensors), name_map=checkpoint_name, dtype=dtype)
    model.speakers = {k: v.to(model.talker.bos_emb) for k, v in extras.speakers.items()}  # its device and dtype
    if extras.silence is not None:
        model.silence_codes.copy_(extras.silence)
    if extras.text_encoder and vocab is not None:
        fill_text_table(model, extras.text_encoder, vocab)
    return extras


def fill_text_table(model: EarTTS, tensors: dict[str, torch.Tensor], vocab: dict[str, int]) -> None:
    """Run the checkpoint's character-aware encoder (``embed_subword.*`` tensors, coverage
    checked both ways) over every token of ``vocab`` into the talker's text table."""
    from mstar.model.eartts.text_encoder import CharAwareEncoder, char_map_with_padding
    from mstar.model.weights import load_weights

    cas = model.config.talker.extra.get("cas_config")
    if not cas:
        raise ValueError("tts_config.cas_config is not set: the checkpoint has no text encoder to run")
    encoder = CharAwareEncoder(cas, model.config.talker.hidden_size, tensors["embed_tokens.weight"].shape[0],
                               tensors["subword_flag_emb.is_continuation"].shape[0],
                               tensors["bos_eos_emb.special_flags"].shape[0])
    load_weights(encoder, tensors.items())
    on, off = encoder.eval().build_tables(char_map_with_padding(vocab), len(vocab) + 1)
    model.talker.text.replace(on, off)
