"""mstar.media.images: safe decoding of untrusted uploads (empty, too large, not an image,
corrupt, truncated, decompression bombs, animations, alpha, EXIF), PNG encoding, and the
"WxH" size rules."""

from __future__ import annotations

import io
import struct
import time
import zlib

import pytest
from PIL import Image

from mstar.media import (
    ImageError,
    check_side,
    decode_image,
    encode_png,
    fit_size,
    parse_size,
)


def png(width: int, height: int, colour: tuple = (200, 30, 40), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header_claiming(width: int, height: int) -> bytes:
    """A tiny, well-formed PNG whose header claims ``width`` x ``height`` RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def reason(data: bytes, **kwargs: int) -> ImageError:
    with pytest.raises(ImageError) as info:
        decode_image(data, **kwargs)
    return info.value


# -------------------------------------------------------------------------- decoding


def test_decodes_to_rgb() -> None:
    image = decode_image(png(300, 200))
    assert image.size == (300, 200) and image.mode == "RGB"
    assert image.getpixel((5, 5)) == (200, 30, 40)
    grey = decode_image(png(20, 10, 128, mode="L"))
    assert grey.mode == "RGB" and grey.getpixel((0, 0)) == (128, 128, 128)


def test_jpeg_and_palette() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (0, 0, 255)).save(buffer, format="JPEG")
    assert decode_image(buffer.getvalue()).size == (64, 48)
    buffer = io.BytesIO()
    Image.new("P", (16, 16), 3).save(buffer, format="GIF")
    assert decode_image(buffer.getvalue()).mode == "RGB"


def test_transparency_becomes_white() -> None:
    image = decode_image(png(8, 8, (255, 0, 0, 0), mode="RGBA"))
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)
    opaque = decode_image(png(8, 8, (255, 0, 0, 255), mode="RGBA"))
    assert opaque.getpixel((0, 0)) == (255, 0, 0)


def test_animation_takes_the_first_frame() -> None:
    frames = [Image.new("RGB", (20, 20), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    image = decode_image(buffer.getvalue())
    assert image.size == (20, 20) and image.getpixel((10, 10)) == (255, 0, 0)


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    Image.new("RGB", (40, 20), (9, 9, 9)).save(buffer, format="JPEG", exif=exif.tobytes())
    assert decode_image(buffer.getvalue()).size == (20, 40)


def test_empty() -> None:
    error = reason(b"")
    assert error.field == "image" and error.status == 400 and "empty" in error.message


def test_too_large_is_checked_first() -> None:
    error = reason(b"not an image at all" * 10, max_bytes=100)
    assert error.status == 413 and "limit is 100" in error.message
    assert reason(png(64, 64), max_bytes=50).status == 413


def test_not_an_image() -> None:
    error = reason(b"%PDF-1.4 hello", field="files")  # type: ignore[arg-type]
    assert error.field == "files" and "not an image" in error.message


@pytest.mark.parametrize("cut", [40, 100, -20])
def test_truncated(cut: int) -> None:
    error = reason(png(300, 200)[:cut])  # cut in the header, in the pixels, in the trailer
    assert error.field == "image" and error.status == 400
    assert "corrupt" in error.message or "not an image" in error.message


def test_bad_checksum() -> None:
    data = bytearray(png(64, 64))
    data[data.index(b"IDAT") + 8] ^= 0xFF  # flip a byte of the compressed pixels
    assert "corrupt" in reason(bytes(data)).message


def test_truncated_jpeg() -> None:
    buffer = io.BytesIO()
    Image.effect_noise((256, 256), 64).convert("RGB").save(buffer, format="JPEG")
    assert "corrupt" in reason(buffer.getvalue()[: len(buffer.getvalue()) // 2]).message


def test_bomb_is_refused_before_decoding() -> None:
    started = time.monotonic()
    error = reason(png_header_claiming(100_000, 100_000))
    assert error.field == "image" and "pixels" in error.message
    error = reason(png_header_claiming(8000, 8000))  # under Pillow's hard limit, over ours
    assert "8000x8000" in error.message
    error = reason(png_header_claiming(300, 300), max_pixels=300 * 299)
    assert "300x300" in error.message and f"{300 * 299}" in error.message
    assert time.monotonic() - started < 2


def test_zero_sized_header() -> None:
    assert reason(png_header_claiming(0, 10)).field == "image"


def test_encode_png_round_trip() -> None:
    image = Image.new("RGB", (33, 17), (1, 2, 3))
    data = encode_png(image)
    assert data.startswith(b"\x89PNG")
    assert decode_image(data).getpixel((32, 16)) == (1, 2, 3)


# ---------------------------------------------------------------------------- sizes


def test_parse_size() -> None:
    assert parse_size("1024x768") == (1024, 768)
    assert parse_size(" 512X256 ") == (512, 256)
    assert parse_size("4096x4096") == (4096, 4096)


@pytest.mark.parametrize(
    "size, words",
    [
        ("abc", "WIDTHxHEIGHT"),
        ("1024", "WIDTHxHEIGHT"),
        ("1024x", "WIDTHxHEIGHT"),
        ("-512x512", "WIDTHxHEIGHT"),
        ("12x12", "between 256 and 4096"),
        ("512x8192", "height must be between"),
        ("1000x1024", "multiple of 16"),
        ("0x512", "positive"),
    ],
)
def test_parse_size_errors(size: str, words: str) -> None:
    with pytest.raises(ImageError) as info:
        parse_size(size)
    assert info.value.field == "size" and words in info.value.message
    assert str(info.value).startswith("size: ")


def test_parse_size_bounds_are_parameters() -> None:
    assert parse_size("64x96", min_side=32, max_side=128, multiple=32) == (64, 96)
    with pytest.raises(ImageError, match="multiple of 64"):
        parse_size("96x64", min_side=32, multiple=64)
    with pytest.raises(ImageError) as info:
        parse_size("8192x8192", max_side=2048, field="image_size")
    assert info.value.field == "image_size"


def test_check_side() -> None:
    assert check_side(512, "width") == 512
    for bad in (True, 512.0, "512", -16, 100, 4112):
        with pytest.raises(ImageError) as info:
            check_side(bad, "width", field="model_kwargs.width")  # type: ignore[arg-type]
        assert info.value.field == "model_kwargs.width"


def test_fit_size() -> None:
    assert fit_size(1023, 777) == (1008, 768)  # rounded down to multiples of 16
    assert fit_size(8000, 2000) == (4096, 1024)  # scaled down, aspect kept
    assert fit_size(100, 50) == (512, 256)  # scaled up to the minimum side
    assert fit_size(10000, 100) == (4096, 256)  # no valid size keeps this aspect: clamped
    for w, h in ((1, 1), (5000, 5000), (257, 4097)):
        fw, fh = fit_size(w, h)
        assert fw % 16 == fh % 16 == 0 and 256 <= min(fw, fh) and max(fw, fh) <= 4096
