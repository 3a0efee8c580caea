"""The rolling self-attention KV cache of a causal rollout.

Each DiT block keeps the rotated keys and the values of the chunks already generated, as the
DiT saw them at time 0 (the clean chunk's "commit" forward). A chunk being denoised attends to
that history plus its own tokens; with a window of ``window_frames`` latent frames the history
is cut to what fits beside the chunk: the first ``sink_frames`` frames (the attention sink) and
the most recent frames after them. One pass over the whole video with ``block_causal_mask``
computes the same thing, which is what the tests check.

Everything is a plain tensor per block, so the whole cache can be held between requests (a
session resuming a rollout) and moved as a unit.
"""

from __future__ import annotations

import torch


class RollingKV:
    def __init__(self, layers: int, window_frames: int | None = None, sink_frames: int = 0) -> None:
        self.window_frames = window_frames
        self.sink_frames = sink_frames
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.frames = 0  # latent frames committed so far (the next chunk's first rotary position)
        self.frame_tokens: int | None = None  # tokens a latent frame (set by the first chunk)

    def _cut(self, x: torch.Tensor, room: int) -> torch.Tensor:
        """``x [B, N, H, D]`` cut to ``room`` tokens: the sink's, then the newest."""
        if x.shape[1] <= room:
            return x
        sink = self.sink_frames * (self.frame_tokens or 0)
        return torch.cat([x[:, :sink], x[:, x.shape[1] - (room - sink):]], dim=1)

    def _room(self, tokens: int) -> int | None:
        """History tokens a chunk of ``tokens`` may see beside itself (None: all)."""
        if self.window_frames is None:
            return None
        return self.window_frames * self.frame_tokens - tokens

    def attend_to(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``[B, M, H, D]`` a chunk's queries see: the windowed history, then
        the chunk's own ``k, v [B, N, H, D]``. Does not change the cache."""
        past_k, past_v = self.keys[layer], self.values[layer]
        if past_k is None:
            return k, v
        room = self._room(k.shape[1])
        if room is not None:
            past_k, past_v = self._cut(past_k, room), self._cut(past_v, room)
        return torch.cat([past_k.to(k), k], dim=1), torch.cat([past_v.to(v), v], dim=1)

    def commit(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append a clean chunk's keys and values to block ``layer``'s history, dropping what no
        later chunk can see."""
        for store, new in ((self.keys, k), (self.values, v)):
            past = store[layer]
            full = new if past is None else torch.cat([past, new], dim=1)
            if self.window_frames is not None:
                full = self._cut(full, self.window_frames * self.frame_tokens)
            store[layer] = full

    def tokens(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[1])


def block_causal_mask(frames: int, frame_tokens: int, chunk_frames: int, window_frames: int | None = None,
                      sink_frames: int = 0, device: torch.device | None = None) -> torch.Tensor:
    """``[N, N]`` bool (True: may attend) for one pass over ``frames`` latent frames that matches
    a chunked rollout: a token of chunk ``c`` sees the frames before the end of its chunk that are
    in the sink or among the last ``window_frames - sink_frames`` up to that end (the window holds
    ``window_frames`` in all, the sink's included)."""
    frame = torch.arange(frames, device=device)
    end = (frame // chunk_frames + 1) * chunk_frames  # the end of each query frame's chunk
    visible = frame[None, :] < end[:, None]
    if window_frames is not None:
        visible &= (frame[None, :] >= end[:, None] - (window_frames - sink_frames)) | (frame[None, :] < sink_frames)
    return visible.repeat_interleave(frame_tokens, 0).repeat_interleave(frame_tokens, 1)
