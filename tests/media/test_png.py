"""The multi-threaded PNG encoder: standard files (two independent decoders read them back
exactly), strips joined into one valid zlib stream, bad input refused."""

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from mstar.media import png


def decode(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG" and image.mode == "RGB"
        image.load()
        return np.asarray(image)


def smooth(height: int, width: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x // 4) % 256, (y // 3) % 256, ((x + y) // 8) % 256], -1).astype(np.uint8)


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (301, 517), (600, 400)])
def test_round_trip(shape, threads, monkeypatch):
    monkeypatch.setattr(png, "_MIN_STRIP_BYTES", 1024)  # small images still split into strips
    noise = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
    for pixels in (noise, smooth(*shape)):
        assert np.array_equal(decode(png.encode_png(pixels, threads=threads)), pixels)


def test_strips_make_one_valid_zlib_stream(monkeypatch):
    """zlib itself checks the joined stream's structure and its Adler-32 while inflating."""
    monkeypatch.setattr(png, "_MIN_STRIP_BYTES", 1024)
    pixels = smooth(200, 300)
    data = png.encode_png(pixels, threads=4)
    chunks = list(_chunks(data))
    assert [kind for kind, _ in chunks] == [b"IHDR"] + [b"IDAT"] * 4 + [b"IEND"]  # one IDAT per strip
    scanlines = zlib.decompress(b"".join(payload for kind, payload in chunks if kind == b"IDAT"))
    assert len(scanlines) == 200 * (3 * 300 + 1)
    assert scanlines[0] == 1  # every row: the Sub filter


def _chunks(data: bytes):
    """(type, payload) of every chunk after the signature; each chunk's CRC-32 checked."""
    at = 8
    while at < len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        kind, payload = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        assert int.from_bytes(data[at + 8 + length:at + 12 + length], "big") == zlib.crc32(kind + payload), kind
        yield kind, payload
        at += 12 + length


def test_level_zero_and_non_contiguous_input():
    pixels = np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    assert np.array_equal(decode(png.encode_png(pixels, level=0)), pixels)
    view = smooth(64, 80)[::2, ::3]
    assert np.array_equal(decode(png.encode_png(view)), view)


def test_adler32_combine_matches_zlib():
    rng = np.random.default_rng(3)
    for a_len, b_len in [(0, 5), (1, 0), (70000, 123457), (5552, 5552)]:
        a, b = rng.bytes(a_len), rng.bytes(b_len)
        assert png._adler32_combine(zlib.adler32(a), zlib.adler32(b), b_len) == zlib.adler32(a + b)


@pytest.mark.parametrize("pixels, message", [
    (np.zeros((4, 4, 3), np.float32), "uint8"),
    (np.zeros((4, 4), np.uint8), "uint8"),
    (np.zeros((4, 4, 4), np.uint8), "uint8"),
    (np.zeros((0, 4, 3), np.uint8), "at least one pixel"),
])
def test_bad_input_is_refused(pixels, message):
    with pytest.raises(ValueError, match=message):
        png.encode_png(pixels)
    with pytest.raises(ValueError, match="level"):
        png.encode_png(np.zeros((2, 2, 3), np.uint8), level=10)
