"""Video containers: uint8 RGB frames -> an H.264 mp4, written with PyAV (``av``, the ``wan22``
extra), which carries its own FFmpeg libraries, so no ``ffmpeg`` binary is needed.

The stream is yuv420p (what every player decodes), so width and height must be even; the
video families' sizes (multiples of 32) always are. ``crf`` 18 is x264's "visually lossless"
end of the scale; ``+faststart`` moves the index to the front so a player can start before
the whole file has arrived.
"""

from __future__ import annotations

import io
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np

INSTALL_HINT = "mp4 output needs PyAV: pip install -e '.[wan22]' (or pip install av)"


def _av():
    try:
        import av
    except ModuleNotFoundError:
        raise ModuleNotFoundError(INSTALL_HINT) from None
    return av


def encode_mp4(frames: np.ndarray, fps: float = 24, crf: int = 18) -> bytes:
    """``uint8 [F, H, W, 3]`` RGB frames -> the bytes of an H.264 mp4 at ``fps`` frames a second."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or not len(frames):
        raise ValueError(f"frames must be uint8 [F, H, W, 3] with F >= 1, got {frames.dtype} {frames.shape}")
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 (yuv420p) needs an even width and height, got {width}x{height}")
    av = _av()
    # A file, not a BytesIO: +faststart rewrites the finished file by name
    with tempfile.TemporaryDirectory(prefix="mstar-mp4-") as folder:
        path = Path(folder) / "video.mp4"
        _write(av, path, frames, fps, crf)
        return path.read_bytes()


def _write(av, path: Path, frames: np.ndarray, fps: float, crf: int) -> None:
    _, height, width, _ = frames.shape
    with av.open(str(path), "w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """An mp4's first video stream as ``uint8 [F, H, W, 3]`` RGB frames, and its frame rate."""
    av = _av()
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        rate = float(stream.average_rate or stream.base_rate or 0)
    return np.stack(frames), rate
