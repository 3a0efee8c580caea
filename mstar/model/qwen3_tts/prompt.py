"""The talker's prompt for one utterance, laid out as the reference's ``generate`` lays it.

The text arrives templated, ``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``
(``assistant_ids``): its first 3 ids are the role, its last 5 the closing. Rows of the prefill,
each a text row (through ``text_projection``) plus a codec row (the talker's codec embedding):

* an optional instruction (``<|im_start|>user\\n{instruct}<|im_end|>\\n``), text rows alone;
* the role's 3 text rows alone;
* the codec prefix ``think/nothink, think_bos, [language], think_eos, [speaker], pad`` under
  ``tts_pad`` text rows, then ``bos`` under ``tts_bos``. The speaker is a built-in speaker's
  codec row (CustomVoice), a clip's x-vector (cloning) or absent (VoiceDesign); the language
  row is absent for ``auto``. A dialect speaker with Chinese or ``auto`` speaks its dialect;
* **streaming text layout** (the default): the first text row over ``bos``; the rest of the
  text and ``tts_eos`` are fed one per frame (``trailing``), then ``tts_pad``;
* **non-streaming layout**: every text row and ``tts_eos`` over ``pad`` codec rows, then
  ``tts_pad`` over ``bos``; the frames see only ``tts_pad``.

* **in-context cloning** (``reference``): after the codec prefix, the clip's transcript, the
  text and ``tts_eos`` as text rows, beside ``bos`` and the clip's frames (each frame its
  codes' embedding sum) as codec rows. Streaming: the two run side by side, the longer text
  going on one row per frame, the shorter padded with ``tts_pad``; non-streaming: all the text
  over codec ``pad`` rows, then the frames under ``tts_pad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar.model.qwen3_tts.config import Qwen3TTSConfig
from mstar.model.qwen3_tts.talker import Qwen3TTSTalker

ROLE, CLOSING = 3, 5  # ids of the role before the text and of the closing after it


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def ref_text(text: str) -> str:
    """A clone clip's transcript templated; its ids less the first ``ROLE`` and the last
    ``REF_CLOSING`` are the prompt's transcript rows (``reference``)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


REF_CLOSING = 2


def transcript_ids(tokenizer, text: str) -> list[int]:
    """A clone clip's transcript rows, as the reference cuts them from ``ref_text(text)``."""
    return list(tokenizer(ref_text(text), add_special_tokens=False)["input_ids"][ROLE:-REF_CLOSING])


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


@dataclass
class TalkerPrompt:
    """An utterance's prefill rows ``[P, H]``, the text rows its frames add one by one
    (``trailing [N, H]``), and ``tts_pad`` ``[H]`` once those run out."""

    embeds: torch.Tensor
    trailing: torch.Tensor
    pad: torch.Tensor

    def text_row(self, step: int) -> torch.Tensor:
        """The text row added to frame ``step``'s codec embedding sum."""
        return self.trailing[step] if step < len(self.trailing) else self.pad


def language_id(config: Qwen3TTSConfig, language: str, speaker: str | None) -> int | None:
    """The codec's language row (``None``: ``auto``); a dialect speaker's dialect when the
    language is Chinese or ``auto``. Unknown names raise ``KeyError`` naming the valid ones."""
    talker, language = config.talker, language.lower()
    if speaker and language in ("chinese", "auto") and talker.spk_is_dialect.get(speaker.lower()):
        return talker.codec_language_id[talker.spk_is_dialect[speaker.lower()]]
    if language == "auto":
        return None
    if language not in talker.codec_language_id:
        raise KeyError(f"language {language!r}: expected auto or one of {', '.join(languages(config)[1:])}")
    return talker.codec_language_id[language]


def languages(config: Qwen3TTSConfig) -> list[str]:
    """The languages a request may name (``auto`` first; dialects follow their speakers)."""
    return ["auto", *sorted(k for k in config.talker.codec_language_id if "dialect" not in k)]


@torch.no_grad()
def talker_prompt(talker: Qwen3TTSTalker, config: Qwen3TTSConfig, assistant_ids: Sequence[int], *,
                  language: str = "auto", speaker: str | None = None, instruct_ids: Sequence[int] | None = None,
                  speaker_embed: torch.Tensor | None = None, non_streaming: bool = False,
                  reference: tuple[Sequence[int], torch.Tensor] | None = None) -> TalkerPrompt:
    """The prompt of one utterance: ``assistant_ids`` (``assistant_text`` tokenized, at least
    one text id), a built-in ``speaker`` or a clip's ``speaker_embed`` ``[H]`` (not both);
    ``reference``: in-context cloning, the clip's transcript ids (between ``ref_text``'s role
    and closing) and its codec frames ``[T, Q]``."""
    device = talker.codec_head.weight.device
    tc = config.talker
    if len(assistant_ids) < ROLE + CLOSING + 1:
        raise ValueError("assistant_ids must hold the role, at least one text id and the closing")
    if speaker is not None and speaker_embed is not None:
        raise ValueError("a prompt takes a built-in speaker or a speaker embedding, not both")

    def text(rows: Sequence[int]) -> torch.Tensor:
        return talker.embed_text(torch.tensor(list(rows), dtype=torch.long, device=device))

    def codec(rows: Sequence[int]) -> torch.Tensor:
        return talker.embed_codec(torch.tensor(list(rows), dtype=torch.long, device=device))

    bos, eos, pad = text([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id])
    lang = language_id(config, language, speaker)
    think = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id] if lang is None else \
        [tc.codec_think_id, tc.codec_think_bos_id, lang, tc.codec_think_eos_id]
    if speaker is not None:
        if speaker.lower() not in tc.spk_id:
            raise KeyError(f"voice {speaker!r}: expected one of {', '.join(sorted(tc.spk_id))}")
        speaker_embed = codec([tc.spk_id[speaker.lower()]])[0]
    prefix = [codec(think)] + ([speaker_embed[None]] if speaker_embed is not None else []) + \
        [codec([tc.codec_pad_id, tc.codec_bos_id])]
    codec_rows = torch.cat(prefix)  # the last row (bos) goes under the first text row
    under = torch.cat([pad.expand(len(codec_rows) - 2, -1), bos[None]]) + codec_rows[:-1]
    rows = [text(instruct_ids)] if instruct_ids else []
    rows += [text(assistant_ids[:ROLE]), under]
    body = assistant_ids[ROLE:-CLOSING]
    if reference is not None:
        ref_ids, ref_codes = reference
        spoken, trailing = in_context_rows(talker, config, text([*ref_ids, *body]), eos, pad, ref_codes,
                                           non_streaming)
        return TalkerPrompt(torch.cat([*rows, spoken]), trailing, pad)
    if non_streaming:
        spoken = torch.cat([text(body), eos[None]]) + codec([tc.codec_pad_id] * (len(body) + 1))
        rows += [spoken, (pad + codec([tc.codec_bos_id])[0])[None]]
        trailing = pad[None]
    else:
        rows.append(text(body[:1]) + codec_rows[-1:])
        trailing = torch.cat([text(body[1:]), eos[None]])
    return TalkerPrompt(torch.cat(rows), trailing, pad)


def frame_embeds(talker: Qwen3TTSTalker, codes: torch.Tensor) -> torch.Tensor:
    """Frames ``[T, Q]`` to the talker's input rows ``[T, H]``: codebook 0 through the talker's
    codec embedding, the others through the code predictor's, summed."""
    rows = talker.embed_codec(codes[:, 0])
    for group, table in enumerate(talker.code_predictor.model.codec_embedding, start=1):
        rows = rows + table(codes[:, group])
    return rows


def in_context_rows(talker: Qwen3TTSTalker, config: Qwen3TTSConfig, text_rows: torch.Tensor, eos: torch.Tensor,
                    pad: torch.Tensor, ref_codes: torch.Tensor, non_streaming: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt rows and the trailing text rows of in-context cloning (see the module doc)."""
    tc = config.talker
    device = text_rows.device
    text_rows = torch.cat([text_rows, eos[None]])
    bos = talker.embed_codec(torch.tensor([tc.codec_bos_id], device=device))
    codec_rows = torch.cat([bos, frame_embeds(talker, ref_codes.to(device))])
    if non_streaming:
        pads = talker.embed_codec(torch.full((len(text_rows),), tc.codec_pad_id, device=device))
        return torch.cat([text_rows + pads, codec_rows + pad]), pad[None]
    if len(text_rows) > len(codec_rows):
        return text_rows[:len(codec_rows)] + codec_rows, text_rows[len(codec_rows):]
    padded = torch.cat([text_rows, pad.expand(len(codec_rows) - len(text_rows), -1)])
    return padded + codec_rows, pad[None]
