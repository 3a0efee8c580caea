"""Video containers: uint8 RGB frames (and a soundtrack: AAC) -> an H.264 mp4, written with PyAV (``av``, the ``wan22``
and ``video`` extras), which carries its own FFmpeg libraries, so no ``ffmpeg`` binary is needed; and back:
``probe_video`` reads a container's frame count, rate and size, ``decode_frames`` decodes only the
frames a sampler picks (video input).

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

INSTALL_HINT = "video files need PyAV: pip install -e '.[video]' (or pip install av)"


def _av():
    try:
        import av
    except ModuleNotFoundError:
        raise ModuleNotFoundError(INSTALL_HINT) from None
    return av


def encode_mp4(frames: np.ndarray, fps: float = 24, crf: int = 18, audio: np.ndarray | None = None,
               sample_rate: int = 48000) -> bytes:
    """``uint8 [F, H, W, 3]`` RGB frames -> the bytes of an H.264 mp4 at ``fps`` frames a second.
    ``audio``: a soundtrack beside it, float ``[channels, samples]`` in [-1, 1] at
    ``sample_rate`` (AAC, 1 or 2 channels)."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or not len(frames):
        raise ValueError(f"frames must be uint8 [F, H, W, 3] with F >= 1, got {frames.dtype} {frames.shape}")
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 (yuv420p) needs an even width and height, got {width}x{height}")
    if audio is not None and (audio.ndim != 2 or audio.shape[0] not in (1, 2)):
        raise ValueError(f"audio must be [channels, samples] with 1 or 2 channels, got {audio.shape}")
    av = _av()
    # A file, not a BytesIO: +faststart rewrites the finished file by name
    with tempfile.TemporaryDirectory(prefix="mstar-mp4-") as folder:
        path = Path(folder) / "video.mp4"
        _write(av, path, frames, fps, crf, audio, sample_rate)
        return path.read_bytes()


def _write(av, path: Path, frames: np.ndarray, fps: float, crf: int, audio: np.ndarray | None,
           sample_rate: int) -> None:
    _, height, width, _ = frames.shape
    with av.open(str(path), "w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf)}
        sound = None
        if audio is not None:
            sound = container.add_stream("aac", rate=sample_rate, layout="stereo" if len(audio) == 2 else "mono")
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames
        if sound is not None:
            _write_audio(av, container, sound, audio, sample_rate)


AAC_FRAME = 1024  # samples per AAC frame


def _write_audio(av, container, sound, audio: np.ndarray, sample_rate: int) -> None:
    """``audio [channels, samples]`` as AAC frames (planar float32, what FFmpeg's encoder takes)."""
    planar = np.ascontiguousarray(np.clip(audio, -1, 1), dtype=np.float32)
    layout = "stereo" if len(planar) == 2 else "mono"
    for start in range(0, planar.shape[1], AAC_FRAME):
        piece = np.ascontiguousarray(planar[:, start:start + AAC_FRAME])
        frame = av.AudioFrame.from_ndarray(piece, format="fltp", layout=layout)
        frame.sample_rate, frame.pts = sample_rate, start
        container.mux(sound.encode(frame))
    container.mux(sound.encode())  # flush


def decode_mp4_audio(data: bytes) -> tuple[np.ndarray, int]:
    """An mp4's first audio stream as float32 ``[channels, samples]`` and its sample rate."""
    av = _av()
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        pieces = [f.to_ndarray() for f in container.decode(stream)]  # fltp: [channels, n]
        rate = int(stream.rate)
    return np.concatenate(pieces, axis=1), rate


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """An mp4's first video stream as ``uint8 [F, H, W, 3]`` RGB frames, and its frame rate."""
    av = _av()
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        rate = float(stream.average_rate or stream.base_rate or 0)
    return np.stack(frames), rate


class VideoDecodeError(ValueError):
    """A video container PyAV cannot read (or one with no video stream)."""


def probe_video(data: bytes) -> tuple[int, float | None, int, int]:
    """A container's first video stream: its frame count, frame rate (None when unknown), width
    and height, read from the header (frames counted from the packets when the header has none),
    nothing decoded."""
    av = _av()
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise VideoDecodeError("the file has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.base_rate
            width, height, count = stream.codec_context.width, stream.codec_context.height, stream.frames
            if not count:
                count = sum(1 for packet in container.demux(stream) if packet.size)
    except VideoDecodeError:
        raise
    except Exception as err:  # PyAV raises FFmpeg's many error kinds
        raise VideoDecodeError(f"cannot read the video: {err}") from None
    return int(count), float(rate) if rate else None, int(width), int(height)


def decode_frames(data: bytes, indices: list[int]) -> np.ndarray:
    """The frames at ``indices`` (ascending, repeats allowed) of a container's first video stream
    as ``uint8 [len(indices), H, W, 3]`` RGB; frames past the last index are never decoded."""
    av = _av()
    wanted: dict[int, int] = {}
    for i in indices:
        wanted[i] = wanted.get(i, 0) + 1
    last, kept = max(indices), []
    try:
        with av.open(io.BytesIO(data)) as container:
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if index in wanted:
                    kept += [frame.to_ndarray(format="rgb24")] * wanted[index]
                if index >= last:
                    break
    except Exception as err:
        raise VideoDecodeError(f"cannot decode the video: {err}") from None
    if len(kept) != len(indices):
        raise VideoDecodeError(f"the video has fewer frames than its header says ({len(kept)} of {len(indices)} "
                               "sampled frames decoded)")
    return np.stack(kept)


def decode_soundtrack(data: bytes) -> tuple[np.ndarray, int] | None:
    """A container's first audio stream as mono float32 samples (channels averaged) and its
    rate; None when the container has no audio stream."""
    av = _av()
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                return None
            stream = container.streams.audio[0]
            planar = av.AudioResampler(format="fltp")  # any sample format -> planar float
            pieces = [f.to_ndarray() for frame in container.decode(stream) for f in planar.resample(frame)]
            pieces += [f.to_ndarray() for f in planar.resample(None)]
            rate = int(stream.rate)
    except Exception as err:
        raise VideoDecodeError(f"cannot decode the video's audio: {err}") from None
    if not pieces:
        return np.zeros(0, dtype=np.float32), rate
    return np.concatenate(pieces, axis=1).mean(axis=0, dtype=np.float32), rate
