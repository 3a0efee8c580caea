"""A streaming polyphase resampler: audio arrives in pieces, and the output of the pieces
joined is the output of the whole signal.

The Realtime API speaks PCM16 at 24 kHz; Silero VAD reads 16 kHz (2:3) and piper writes
22.05 kHz (160:147). ``scipy.signal.resample_poly`` is exact but wants the whole signal, and
resampling each piece on its own clicks at every seam (each piece is zero-padded at its
edges). ``StreamResampler`` applies the same filter (a Kaiser-windowed sinc of
``10 * max(up, down)`` taps a side, as scipy designs it) as a polyphase sum, keeping the
input samples the next outputs still need, so its output equals ``resample_poly``'s on the
signal so far (tests/server/test_realtime_resample.py pins that).
"""

from __future__ import annotations

from math import gcd

import numpy as np

__all__ = ["StreamResampler", "float_to_pcm16", "pcm16_to_float"]


class StreamResampler:
    """Resample from ``src`` Hz to ``dst`` Hz, piece by piece. ``push`` returns every output
    sample the input so far determines; ``flush`` ends the stream (the filter's tail, against
    zeros after the last input) and returns the rest, so that the total is
    ``ceil(inputs * dst / src)`` samples, as ``resample_poly`` gives."""

    def __init__(self, src: int, dst: int) -> None:
        from scipy.signal import firwin  # here, not at import: scipy.signal took 0.6 s of every server start

        g = gcd(src, dst)
        self.up, self.down = dst // g, src // g
        self.half_len = 10 * max(self.up, self.down)
        taps = firwin(2 * self.half_len + 1, 1.0 / max(self.up, self.down), window=("kaiser", 5.0)) * self.up
        self.taps_per_phase = -(-len(taps) // self.up)
        padded = np.zeros(self.taps_per_phase * self.up)
        padded[: len(taps)] = taps
        # phases[p, k] multiplies x[i0 - k] for an output whose upsampled index t has t % up == p
        self.phases = padded.reshape(self.taps_per_phase, self.up).T.copy()
        self._reset()

    def push(self, samples: np.ndarray) -> np.ndarray:
        """The outputs ``samples`` (appended to the stream) complete, float32."""
        x = np.asarray(samples, np.float64).reshape(-1)
        self._inputs += len(x)
        return self._emit(x, limit=None)

    def flush(self) -> np.ndarray:
        """The stream's last outputs; the resampler then starts a new stream."""
        total = -(-self._inputs * self.up // self.down)
        tail = self._emit(np.zeros(self.half_len // self.up + 2), limit=total)
        self._reset()
        return tail

    def _reset(self) -> None:
        self._buf_start = -(self.taps_per_phase - 1)  # the stream index of _buf[0]
        self._inputs = 0  # since the stream began
        self._outputs = 0
        # zeros before the first input, as resample_poly pads
        self._buf = np.zeros(self.taps_per_phase - 1)

    def _emit(self, x: np.ndarray, limit: int | None) -> np.ndarray:
        self._buf = np.concatenate([self._buf, x])
        available = self._buf_start + len(self._buf)  # stream index one past the last input held
        # output n needs inputs up to (n * down + half_len) // up
        last = (available * self.up - 1 - self.half_len) // self.down
        if limit is not None:
            last = min(last, limit - 1)
        n = np.arange(self._outputs, last + 1)
        if len(n) == 0:
            return np.zeros(0, np.float32)
        t = n * self.down + self.half_len
        i0 = t // self.up
        index = i0[:, None] - np.arange(self.taps_per_phase)[None, :] - self._buf_start
        out = np.einsum("nk,nk->n", self._buf[index], self.phases[t % self.up])
        self._outputs = int(n[-1]) + 1
        # keep what the next output's sum reaches back to
        t_next = self._outputs * self.down + self.half_len
        keep_from = t_next // self.up - (self.taps_per_phase - 1)
        drop = max(0, keep_from - self._buf_start)
        self._buf, self._buf_start = self._buf[drop:], self._buf_start + drop
        return out.astype(np.float32)


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian PCM16 to float32 in [-1, 1)."""
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def float_to_pcm16(samples: np.ndarray) -> bytes:
    """Float samples to little-endian PCM16, clipped."""
    scaled = np.clip(np.round(np.asarray(samples, np.float64) * 32767.0), -32768, 32767)
    return scaled.astype("<i2").tobytes()
