"""Qwen3-Omni speech out, one request end to end: thinker -> talker -> code predictor -> code2wav.

The thinker answers in text. The talker then speaks that answer, one codec frame a step, from
a prompt built out of the thinker's run (``talker_prompt``):

* **user rows**: every token of the prompt's user turns (from an ``<|im_start|>user`` up to the
  next ``<|im_start|>``; system and earlier assistant turns are left out), as the thinker's
  input embedding through ``text_projection``, or for an audio token the thinker's
  ``accept_hidden_layer`` state through ``hidden_projection``;
* **assistant rows** (9): from the last ``<|im_start|>assistant`` (``a``) on, a text part
  ``[e(a), e(a+1), e(a+2), pad, pad, pad, pad, bos, e(a+3)]`` (``e``: projected thinker
  embeddings, ``pad/bos``: the projected ``tts_pad`` / ``tts_bos`` tokens) plus a codec part
  ``[0, 0, 0, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos]`` (talker codec
  embeddings), so ``e(a+3)``, the answer's first token, sits on ``codec_bos``;
* **trailing text rows**: the rest of the answer, ``e(a+4) ..``, then ``tts_eos``; talker decode
  step ``k`` adds row ``k`` (``tts_pad`` once they are used up) to its frame's embedding sum.

Only the tokens the thinker ran are embedded: its last generated token (the EOS, or the one
drawn at the length limit) never is, as in the reference. Without images or video the talker's
positions are ``0 .. P - 1`` on all three MRoPE axes for its ``P`` prompt rows and ``P + k`` at
decode step ``k`` (ordinary 1-D positions, what the paged metadata carries).

``speak`` is a plain-torch greedy driver over the pieces (``run_thinker``, ``talker_prompt``,
``run_talker``, code2wav's ``chunked_decode``); the runtime's nodes will call the pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.model.qwen3_omni.code2wav import Qwen3OmniCode2Wav
from mstar.model.qwen3_omni.modeling import Qwen3OmniThinkerForCausalLM
from mstar.model.qwen3_omni.talker import Qwen3OmniTalker


@dataclass(frozen=True)
class ChatTokens:
    """The thinker-vocabulary ids the talker prompt is cut and built with (released defaults)."""

    im_start: int = 151644
    im_end: int = 151645  # the thinker's EOS in the reference's ``generate``
    user: int = 872
    assistant: int = 77091
    tts_pad: int = 151671
    tts_bos: int = 151672
    tts_eos: int = 151673
    audio: int = 151646
    image: int = 151655
    video: int = 151656

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ChatTokens:
        """From a whole Omni ``config.json`` dict (``thinker_config`` holds the media ids)."""
        thinker = d.get("thinker_config") or {}
        keys = dict(im_start="im_start_token_id", user="user_token_id", assistant="assistant_token_id",
                    tts_pad="tts_pad_token_id", tts_bos="tts_bos_token_id", tts_eos="tts_eos_token_id")
        media = dict(audio="audio_token_id", image="image_token_id", video="video_token_id")
        kwargs = {k: d[v] for k, v in keys.items() if d.get(v) is not None}
        kwargs.update({k: thinker[v] for k, v in media.items() if thinker.get(v) is not None})
        return cls(**kwargs)


@dataclass
class TalkerPrompt:
    """What the talker needs for one request."""

    embeds: torch.Tensor  # [P, H]: the prompt rows (user rows, then the 9 assistant rows)
    trailing: torch.Tensor  # [R, H]: the text row of decode step k < R (the last one is tts_eos)
    pad: torch.Tensor  # [H]: the text row of decode steps k >= R (tts_pad)

    def text_row(self, step: int) -> torch.Tensor:
        """The text side of talker decode step ``step`` (0: the step after the prompt)."""
        return self.trailing[step] if step < self.trailing.shape[0] else self.pad


def user_rows(prompt_ids: Sequence[int], tokens: ChatTokens) -> list[int]:
    """Indexes of the prompt's user-turn tokens: those whose latest ``<|im_start|>`` (itself
    included) is followed by the user role token (tokens before any ``<|im_start|>`` read the
    role at index 1, as the reference does)."""
    rows, start = [], 0
    for i, tok in enumerate(prompt_ids):
        if tok == tokens.im_start:
            start = i
        if prompt_ids[min(start + 1, len(prompt_ids) - 1)] == tokens.user:
            rows.append(i)
    return rows


def assistant_start(prompt_ids: Sequence[int], tokens: ChatTokens) -> int:
    """Index of the prompt's last ``<|im_start|>assistant``."""
    starts = [i for i in range(len(prompt_ids) - 1)
              if prompt_ids[i] == tokens.im_start and prompt_ids[i + 1] == tokens.assistant]
    if not starts:
        raise ValueError("the prompt has no <|im_start|>assistant turn for the talker to speak")
    return starts[-1]


@torch.no_grad()
def talker_prompt(talker: Qwen3OmniTalker, tokens: ChatTokens, speaker_id: int, prompt_ids: Sequence[int],
                  generated_ids: Sequence[int], thinker_embeds: torch.Tensor, thinker_hidden: torch.Tensor | None,
                  tts_embeds: torch.Tensor) -> TalkerPrompt:
    """The talker's prompt and text rows for one request.

    ``thinker_embeds`` / ``thinker_hidden`` (``[n, thinker_hidden_size]``, ``n >= L + G - 1``
    for ``L`` prompt and ``G`` generated ids): the thinker's input embeddings and its
    ``accept_hidden_layer`` states over the tokens it ran (the hidden states are read only at
    audio tokens); ``tts_embeds [3, thinker_hidden_size]``: the thinker's input embeddings of
    ``tts_bos``, ``tts_eos``, ``tts_pad``. Image and video prompts are refused (their talker
    positions are not 1-D)."""
    prompt_ids, ids = list(prompt_ids), list(prompt_ids) + list(generated_ids)
    if any(t in (tokens.image, tokens.video) for t in prompt_ids):
        raise NotImplementedError("talker_prompt: image and video prompts are not supported yet "
                                  "(the talker's 3-axis positions)")
    ran = len(ids) - 1  # the last generated token is never run through the thinker
    if thinker_embeds.shape[0] < ran:
        raise ValueError(f"thinker_embeds has {thinker_embeds.shape[0]} rows for {ran} run tokens")
    a = assistant_start(prompt_ids, tokens)
    if ran < a + 4:
        raise ValueError(f"the answer is too short for the talker: {len(generated_ids)} generated ids leave "
                         f"{ran - a} run tokens from <|im_start|>assistant, it needs 4")
    config = talker.config
    project = talker.text_projection
    bos, eos, pad = project(tts_embeds).unbind(0)

    users = user_rows(prompt_ids, tokens)
    user = project(thinker_embeds[users])
    audio = [j for j, i in enumerate(users) if prompt_ids[i] == tokens.audio]
    if audio:
        if thinker_hidden is None:
            raise ValueError("an audio prompt needs the thinker's accept_hidden_layer states")
        user[audio] = talker.hidden_projection(thinker_hidden[[users[j] for j in audio]])

    answer = project(thinker_embeds[a:ran])  # e(a) .. e(ran - 1)
    text = torch.cat((answer[:3], pad.expand(4, -1), bos[None], answer[3:4]))
    specials = torch.tensor([config.codec_nothink_id, config.codec_think_bos_id, config.codec_think_eos_id,
                             speaker_id, config.codec_pad_id, config.codec_bos_id], device=answer.device)
    codec = torch.cat((answer.new_zeros(3, answer.shape[1]), talker.embed_codec(specials)))
    return TalkerPrompt(embeds=torch.cat((user, text + codec)), trailing=torch.cat((answer[4:], eos[None])),
                        pad=pad)


def sequence_metadata(start: int, count: int, page_size: int, device: torch.device) -> PagedAttentionMetadata:
    """Metadata of one request's step: ``count`` tokens at positions ``start ..``, the request's
    KV on pages ``0, 1, ..`` in order (so a token's slot is its position)."""
    end = start + count
    positions = torch.arange(start, end, device=device)
    return PagedAttentionMetadata(
        positions=positions, slot_mapping=positions, query_start_loc=torch.tensor([0, count], device=device),
        seq_lens=torch.tensor([end], device=device),
        page_table=torch.arange(-(-end // page_size), device=device)[None], page_size=page_size,
        host_query_start_loc=(0, count), host_seq_lens=(end,))


def new_caches(layers: int, heads: int, head_dim: int, tokens: int, page_size: int,
               like: torch.Tensor) -> list[torch.Tensor]:
    return allocate_kv_cache(layers, -(-tokens // page_size), page_size, heads, head_dim, like.dtype, like.device)


@dataclass
class ThinkerRun:
    """A greedy thinker run of one request."""

    generated: list[int]  # the answer's ids (ending with the EOS when one was drawn)
    embeds: torch.Tensor  # [n, H]: input embeddings of the n = L + G - 1 tokens it ran
    hidden: torch.Tensor  # [n, H]: their ``layer`` hidden states


@torch.no_grad()
def run_thinker(thinker: Qwen3OmniThinkerForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int,
                eos_token_ids: Sequence[int], layer: int, page_size: int = 16,
                prompt_embeds: torch.Tensor | None = None) -> ThinkerRun:
    """Greedy text of a prompt without images (up to an EOS or ``max_new_tokens`` ids), keeping
    the input embeddings and the ``layer`` states the talker prompt reads. ``prompt_embeds``
    ``[L, H]``: the prompt's input embeddings when they are not the ids' own (audio spliced in)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens}: the thinker must draw at least one token")
    weight = thinker.model.embed_tokens.weight
    text = thinker.text_config
    caches = new_caches(text.num_hidden_layers, text.num_key_value_heads, text.head_dim,
                        len(prompt_ids) + max_new_tokens, page_size, weight)
    step_ids = torch.tensor(list(prompt_ids), device=weight.device)
    generated: list[int] = []
    embeds, hidden, start = [], [], 0
    while len(generated) < max_new_tokens:
        x = thinker.model.embed_tokens(step_ids) if prompt_embeds is None or start else prompt_embeds
        meta = sequence_metadata(start, len(step_ids), page_size, weight.device)
        final, kept = thinker.forward_keeping(None, meta, caches, layer, inputs_embeds=x)
        embeds.append(x)
        hidden.append(kept)
        start += len(step_ids)
        token = int(thinker.compute_logits(final[-1:]).argmax(dim=-1))
        generated.append(token)
        if token in eos_token_ids:
            break
        step_ids = torch.tensor([token], device=weight.device)
    return ThinkerRun(generated, torch.cat(embeds), torch.cat(hidden))


def default_suppressed_codes(talker: Qwen3OmniTalker) -> list[int]:
    """The codebook-0 ids the reference never lets the talker draw: the top 1024 of its
    vocabulary (the codec's special tokens, 2048 .. 3071 released) but the codec EOS."""
    vocab, eos = talker.config.text.vocab_size, talker.config.codec_eos_token_id
    return [i for i in range(max(vocab - 1024, 0), vocab) if i != eos]


def special_codes(talker: Qwen3OmniTalker) -> list[int]:
    """Every codebook-0 id above the codes (the code predictor's vocabulary) but the codec EOS:
    the reference's suppressed ids on the released sizes (``default_suppressed_codes``), and the
    same rule on a smaller vocabulary, where the top 1024 would be all of it."""
    vocab, eos = talker.config.text.vocab_size, talker.config.codec_eos_token_id
    return [i for i in range(talker.config.code_predictor.vocab_size, vocab) if i != eos]


@torch.no_grad()
def run_talker(talker: Qwen3OmniTalker, prompt: TalkerPrompt, max_frames: int,
               suppressed: Sequence[int] | None = None, page_size: int = 16) -> torch.Tensor:
    """Greedy codec frames ``[Q, T]`` until codebook 0 draws the codec EOS or ``T = max_frames``:
    each step draws codebook 0 from the codec head (``suppressed`` ids masked out), the code
    predictor fills the frame, and the frame's embedding sum plus the step's text row is the
    next input."""
    config = talker.config
    suppressed = default_suppressed_codes(talker) if suppressed is None else list(suppressed)
    layers, heads, head_dim = talker.cache_shape()
    x = prompt.embeds
    caches = new_caches(layers, heads, head_dim, x.shape[0] + max_frames, page_size, x)
    frames, start = [], 0
    for step in range(max_frames):
        hidden = talker(x, sequence_metadata(start, x.shape[0], page_size, x.device), caches)[-1:]
        start += x.shape[0]
        logits = talker.compute_logits(hidden)
        logits[:, suppressed] = float("-inf")
        code0 = logits.argmax(dim=-1)
        if int(code0) == config.codec_eos_token_id:
            break
        frame = talker.predict_frame(hidden, code0)
        frames.append(frame.codes[0])
        x = frame.embeds + prompt.text_row(step)
    if not frames:
        return torch.zeros(config.num_code_groups, 0, dtype=torch.long, device=x.device)
    return torch.stack(frames, dim=1)


@dataclass
class Speech:
    """One request's spoken answer."""

    text_ids: list[int]  # the thinker's answer
    codes: torch.Tensor  # [Q, T] codec frames
    waveform: torch.Tensor  # [N] samples in [-1, 1]


@torch.no_grad()
def speak(thinker: Qwen3OmniThinkerForCausalLM, talker: Qwen3OmniTalker, code2wav: Qwen3OmniCode2Wav,
          prompt_ids: Sequence[int], tokens: ChatTokens, speaker_id: int, max_new_tokens: int, max_frames: int,
          eos_token_ids: Sequence[int] | None = None, suppressed: Sequence[int] | None = None,
          chunk_size: int = 300, left_context: int = 25, page_size: int = 16) -> Speech:
    """Greedy speech for a text-only chat prompt (ending with ``<|im_start|>assistant\\n``):
    the thinker's answer, the talker's frames and code2wav's chunked decode of them."""
    eos = [tokens.im_end] if eos_token_ids is None else list(eos_token_ids)
    run = run_thinker(thinker, prompt_ids, max_new_tokens, eos, talker.config.accept_hidden_layer, page_size)
    tts = thinker.model.embed_tokens(torch.tensor([tokens.tts_bos, tokens.tts_eos, tokens.tts_pad],
                                                  device=run.embeds.device))
    prompt = talker_prompt(talker, tokens, speaker_id, prompt_ids, run.generated, run.embeds, run.hidden, tts)
    codes = run_talker(talker, prompt, max_frames, suppressed, page_size)
    wav = (code2wav.chunked_decode(codes, chunk_size, left_context) if codes.shape[1]
           else codes.new_zeros(0, dtype=torch.float32))
    return Speech(run.generated, codes, wav)
