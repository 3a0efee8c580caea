"""The multilingual T3's hallucination guard: text-speech alignment read from attention.

A few attention heads of the multilingual T3 align each speech step with the text token being
spoken (layer 12 head 15, layer 13 head 11, layer 9 head 2 of the released model:
``T3Config.alignment_heads``). The
reference (``AlignmentStreamAnalyzer``) averages their attention over the text, follows the
position it points at, and edits the guided logits of every step before they are filtered:

* while the alignment is more than three tokens short of the text's end (texts of more than
  five tokens), the stop token is suppressed (its logit set to -2^15);
* when the alignment has reached the end and then lingers on the last tokens for 5 frames
  (a long tail), or strays back to earlier text for more than 5 frames' worth (a repetition),
  or the last two drawn tokens are the same (with at least three in the history, the
  start-of-speech token counted), the stop token is forced.

``AlignmentSpy`` computes those heads' attention probabilities for the conditional row from
the same queries and cached keys the paged attention used (the paged kernels return no
weights), through forward hooks on the chosen layers; ``AlignmentGuard`` is the per-request
state machine. Only the Llama variants have the heads; the reference runs the guard for the
multilingual model alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.layers.rotary import apply_rotary_qk

FORCE = 2.0**15  # the reference's logit for a forced or suppressed token


class AlignmentSpy:
    """Attention probabilities ``[queries, keys]`` of chosen heads for some sequences of each
    step (``watch``, by their index in the step's batch): per sequence, the mean over the
    heads, after the step's forward."""

    def __init__(self, layers: nn.ModuleList, heads: Sequence[tuple[int, int]]) -> None:
        self.heads = tuple(heads)
        self.sequences: list[int] = []
        self.maps: dict[int, dict[int, torch.Tensor]] = {}  # sequence -> head's index -> its latest map
        self._hooks = [layers[layer].self_attn.register_forward_hook(self._hook(i, head))
                       for i, (layer, head) in enumerate(self.heads)]

    def watch(self, sequences: list[int]) -> None:
        """Record these sequences (indices in the coming steps' batches) from now on."""
        self.sequences = list(sequences)
        self.maps = {b: {} for b in self.sequences}

    def attention(self, sequence: int) -> torch.Tensor:
        """A watched sequence's mean attention over the heads in the last step."""
        maps = self.maps.get(sequence, {})
        if len(maps) != len(self.heads):
            raise RuntimeError(f"no attention recorded for sequence {sequence}: watch it before the step")
        return torch.stack([maps[i] for i in range(len(self.heads))]).mean(dim=0)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _hook(self, index: int, head: int):
        def record(module: nn.Module, args: tuple, _output: torch.Tensor) -> None:
            if not self.sequences:
                return
            x, (cos, sin), meta, kv_cache = args
            for b in self.sequences:
                self.maps[b][index] = _head_probs(module, x, cos, sin, meta, kv_cache, b, head)
        return record


def _head_probs(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: PagedAttentionMetadata, kv_cache: torch.Tensor, b: int, head: int) -> torch.Tensor:
    """Softmax attention ``[n, L]`` of one query head for sequence ``b``'s ``n`` new tokens over
    its ``L`` cached keys (causal), the maths of the paged attention's, in float32."""
    start, end = meta.query_starts[b], meta.query_starts[b + 1]
    length = meta.seq_lens_list[b]
    tokens = x.shape[0]
    q, k, _ = (part.view(tokens, -1, attn.head_dim) for part in attn.qkv_proj.split_output(attn.qkv_proj(x)))
    q, _ = apply_rotary_qk(q, k, cos, sin)
    group = attn.num_heads // attn.num_kv_heads
    size = meta.page_size
    pages = meta.page_table[b, : -(-length // size)].to(x.device)
    slots = (pages[:, None] * size + torch.arange(size, device=x.device)).reshape(-1)[:length]
    keys = kv_cache[0].reshape(-1, *kv_cache.shape[-2:]).index_select(0, slots)[:, head // group].float()
    scores = (q[start:end, head].float() @ keys.T) * attn.scale
    positions = meta.positions[start:end].to(x.device)
    scores = scores.masked_fill(torch.arange(length, device=x.device)[None] > positions[:, None], float("-inf"))
    return scores.softmax(dim=-1)


class AlignmentGuard:
    """One request's alignment state (the reference's analyzer). ``text`` is the ``(start,
    end)`` of the text rows in the prompt; ``step`` takes the guided logits ``[1, V]``, the
    watched attention of the step that made them (the whole prefill's at the first step, one
    row after) and the last token (the start-of-speech token at the first step)."""

    def __init__(self, text: tuple[int, int], stop_token: int) -> None:
        self.start, self.end = text
        self.stop_token = stop_token
        self.alignment = torch.zeros(0, self.end - self.start)
        self.frame = 0
        self.text_position = 0
        self.started = False
        self.complete = False
        self.completed_at: int | None = None
        self.history: list[int] = []

    def step(self, logits: torch.Tensor, attention: torch.Tensor, last_token: int) -> torch.Tensor:
        rows = attention[self.end:] if self.frame == 0 else attention
        chunk = rows[:, self.start:self.end].float().cpu().clone()
        chunk[:, self.frame + 1:] = 0  # the alignment may advance one text token per frame at most
        self.alignment = torch.cat((self.alignment, chunk))
        frames, text_len = self.alignment.shape

        position = int(chunk[-1].argmax())
        if -4 < position - self.text_position < 7:  # a jump further than that is ignored
            self.text_position = position
        a = self.alignment
        false_start = not self.started and (a[-2:, -2:].max() > 0.1 or a[:, :4].max() < 0.5)
        self.started = not false_start
        self.complete = self.complete or self.text_position >= text_len - 3
        if self.complete and self.completed_at is None:
            self.completed_at = frames
        tail = a[self.completed_at:] if self.complete else None
        long_tail = tail is not None and bool(tail[:, -3:].sum(dim=0).max() >= 5)
        # (the reference fails here on texts of five tokens or fewer, which have no earlier text)
        repetition = tail is not None and text_len > 5 and bool(tail[:, :-5].max(dim=1).values.sum() > 5)
        self.history = [*self.history, last_token][-8:]
        repeated = len(self.history) >= 3 and self.history[-1] == self.history[-2]

        logits = logits.clone()
        if position < text_len - 3 and text_len > 5:
            logits[..., self.stop_token] = -FORCE
        if long_tail or repetition or repeated:
            logits = torch.full_like(logits, -FORCE)
            logits[..., self.stop_token] = FORCE
        self.frame += 1
        return logits
