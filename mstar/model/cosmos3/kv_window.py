"""A ``window_mode: kv`` rollout's committed keys and values, kept on the denoise node.

A kv rollout is one long latent video cut into windows of ``L`` latent frames with no overlap.
Window ``w`` sits at latent frames ``w L .. w L + L - 1`` of the whole rollout (its rotary
positions are that slice of the whole rollout's grid) and is denoised on its own, its media rows
attending to the prompt's text, to the committed K/V of the frames before it and to each other
(block-causal across windows, bidirectional inside one). Once a window's last step is taken, a
commit pass runs its finished latents through the tower once more as clean frames (the
conditioning frames' convention: no time embedding) and keeps every layer's keys (normed,
rotated) and values of its rows; those are what later windows read. Each guidance row (the
prompt's and the negative prompt's) keeps its own, since the rows' K/V depend on the text they
attended to. Frames more than ``keep`` latent frames behind the frontier are released after each
commit (``keep`` 0 holds them all), so the attended length stays bounded.

Equivalently, window ``w``'s step is one forward of the sequence [text, the earlier windows'
clean latents, window ``w``'s noisy latents] in which a media row of window ``v`` attends to the
text, to its own window and to the frames of earlier windows at most ``keep`` latent frames
before window ``v``'s first (``tests/model/cosmos3/test_cosmos3_kv_window.py`` checks that).

Sessions: a kv rollout with a ``session_id`` commits its last window too and keeps the cache in
the ``dit`` node's session store; a resume denoises its windows after the kept frontier, at the
positions the whole rollout would give them, reading the kept K/V, so an opening and a resume
with the same prompt equal one rollout of all their windows. A resume's prompt is encoded
afresh (a new prompt steers the same world): its text K/V are its own, the committed media K/V
and each row's media rotary offset are the opening's.
"""

from __future__ import annotations

import torch

KV = tuple[torch.Tensor, torch.Tensor]


def context_latents(context_frames: int) -> int:
    """``context_frames`` pixel frames as latent frames (1 + (n - 1) // 4, i.e. ceil(n / 4)); 0 stays 0."""
    return 0 if context_frames == 0 else 1 + (context_frames - 1) // 4


class CommittedKV:
    """One rollout's committed K/V: per guidance row, per layer, ``(k, v)`` of shape
    ``[frames * per_frame, kv_heads, head_dim]`` (the held frames, oldest first), and each row's
    media rotary offset (its prompt's length plus the modality margin), which later windows keep
    so their positions go on from the committed ones'.

    A rollout with a session keeps this object in the ``dit`` node's session store (it grows in
    place as windows commit), so a resume goes on from it; ``nbytes`` is what it holds."""

    def __init__(self, rows: int, per_frame: int, keep: int) -> None:
        self.layers: list[list[KV] | None] = [None] * rows
        self.offsets: list[int] = []  # per guidance row, set by the engine on the rollout's first step
        self.per_frame, self.keep = per_frame, keep
        self.position = 0  # latent frames committed so far: the frontier, where the next window starts
        self.frames = 0  # latent frames held

    def past(self, row: int) -> list[KV] | None:
        """Guidance row ``row``'s committed K/V per layer (None before the first commit)."""
        return self.layers[row]

    def window_positions(self, positions: torch.Tensor, latents: int) -> torch.Tensor:
        """The slice of the whole rollout's rotary ``positions [3, N]`` of the ``latents`` frames
        after the frontier (the window now denoised)."""
        return positions[:, self.position * self.per_frame:(self.position + latents) * self.per_frame]

    def commit(self, kept: list[list[KV]], latents: int) -> None:
        """Append one finished window's K/V (``kept[row][layer]``, ``latents`` frames) and release
        the frames more than ``keep`` behind the new frontier."""
        if len(kept) != len(self.layers):
            raise ValueError(f"a commit of {len(kept)} guidance rows into a cache of {len(self.layers)}")
        frames = self.frames + latents
        drop = max(0, frames - self.keep) * self.per_frame if self.keep else 0
        for row, layers in enumerate(kept):
            old = self.layers[row] or [(k[:0], v[:0]) for k, v in layers]
            self.layers[row] = [(torch.cat([ok, k])[drop:], torch.cat([ov, v])[drop:])
                                for (ok, ov), (k, v) in zip(old, layers)]
        self.frames = frames - drop // self.per_frame
        self.position += latents

    def with_rows(self, rows: int) -> None:
        """A resume whose guidance rows differ from the rollout's: row ``j`` goes on from the
        rollout's row ``min(j, rows - 1)`` (a guided resume of an unguided rollout reads the
        prompt row's cache for its negative row too; an unguided resume keeps the prompt row)."""
        self.layers = [self.layers[min(j, len(self.layers) - 1)] for j in range(rows)]
        self.offsets = [self.offsets[min(j, len(self.offsets) - 1)] for j in range(rows)]

    @property
    def nbytes(self) -> int:
        """Bytes of the held keys and values (a tensor shared by two rows counted once)."""
        seen: dict[int, int] = {}
        for layers in self.layers:
            for k, v in layers or ():
                seen[id(k)], seen[id(v)] = k.nbytes, v.nbytes
        return sum(seen.values())
