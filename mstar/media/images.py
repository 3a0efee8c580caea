"""Images for image models: decode an untrusted upload, encode PNG (JPEG, WebP), parse "WxH" sizes.

``decode_image`` is safe on hostile input: the byte length is checked first, the pixel
count is read from the header and checked before any pixel is decoded (a small file
claiming 100000x100000 pixels is refused without allocating them), the file is verified
and then fully decoded, so a corrupt or truncated file fails here with an ``ImageError``
that names the request field, never later inside the model.
"""

from __future__ import annotations

import io
import re
import struct
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mstar.media import png

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_PIXELS = 6144 * 6144  # ~38 MP: any camera photo, ~113 MB as RGB
SIZE_MULTIPLE = 16  # latent diffusion models work on 8x8 latents of 2x2 patches
MIN_SIDE = 256
MAX_SIDE = 4096

_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}


class ImageError(ValueError):
    """An unusable image or size; ``field`` is the request field to blame and ``status``
    the HTTP status it deserves (413: the upload is too large)."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status


def _open(data: bytes, max_pixels: int, field: str) -> Image.Image:
    """The image's header (no pixels yet). Pillow's own bomb warning is silenced: the
    caller applies ``max_pixels``; what is past Pillow's hard limit (2x its warning
    limit, ~179 MP) Pillow refuses here already."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise ImageError(field, f"the image has more than {max_pixels} pixels") from None
    except UnidentifiedImageError:
        raise ImageError(field, "not an image, or a format this server cannot read") from None
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow reports bad headers these ways
        raise ImageError(field, f"the image is corrupt: {exc}") from None


def _check_pixels(image: Image.Image, max_pixels: int, field: str) -> None:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(field, f"the image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        message = f"the image is {width}x{height} pixels; the limit is {max_pixels} pixels"
        raise ImageError(field, message)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent pixels become white (not whatever colour hides under alpha 0)."""
    has_alpha = image.mode in _ALPHA_MODES or "transparency" in image.info
    if not has_alpha:
        return image if image.mode == "RGB" else image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def decode_image(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    field: str = "image",
) -> Image.Image:
    """The upload ``data`` as an RGB image (the first frame of an animation, EXIF
    orientation applied). Raises ``ImageError`` naming ``field``: empty, more than
    ``max_bytes`` (413), more than ``max_pixels`` pixels, not an image, or corrupt."""
    if not data:
        raise ImageError(field, "the image is empty")
    if len(data) > max_bytes:
        raise ImageError(field, f"the image is {len(data)} bytes; the limit is {max_bytes}", 413)
    probe = _open(data, max_pixels, field)
    _check_pixels(probe, max_pixels, field)  # before a single pixel is decoded
    try:
        probe.verify()  # checksums and structure; the image is unusable afterwards
        image = _open(data, max_pixels, field)  # so open it again for the pixels
        _check_pixels(image, max_pixels, field)
        image.seek(0)  # the first frame of an animation
        image.load()
        image = ImageOps.exif_transpose(image) or image
        return _to_rgb(image)
    except ImageError:
        raise
    except Image.DecompressionBombError:
        raise ImageError(field, f"the image has more than {max_pixels} pixels") from None
    except (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error) as exc:
        raise ImageError(field, f"the image is corrupt: {exc}") from None


def encode_png(image: Image.Image) -> bytes:
    """``image`` as PNG bytes (light compression: the models' outputs are large)."""
    return encode_image(np.asarray(image.convert("RGB")))


OUTPUT_FORMATS = ("png", "jpeg", "webp")
DEFAULT_QUALITY = 100  # OpenAI's default output_compression for jpeg and webp


def encode_image(pixels: np.ndarray, output_format: str = "png", quality: int | None = None) -> bytes:
    """RGB ``pixels`` (``uint8 [H, W, 3]``) as ``output_format`` bytes; ``quality`` (0-100,
    default 100) for the lossy formats.

    PNG is deflated on several cores at once (``mstar.media.png``; a 1024x1024 image is 3 MB
    of pixels, tens of milliseconds for one core); JPEG and WebP go through Pillow."""
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output format must be one of {list(OUTPUT_FORMATS)}, got {output_format!r}")
    pixels = np.ascontiguousarray(pixels)
    if output_format == "png":
        return png.encode_png(pixels)
    buffer = io.BytesIO()
    image = Image.fromarray(pixels, "RGB")
    quality = DEFAULT_QUALITY if quality is None else quality
    if output_format == "jpeg":
        image.save(buffer, format="JPEG", quality=max(quality, 1))
    else:  # webp: quality 100 is still lossy (Pillow's lossless mode is far slower)
        image.save(buffer, format="WEBP", quality=quality, method=0)
    return buffer.getvalue()


def parse_size(
    size: str,
    *,
    min_side: int = MIN_SIDE,
    max_side: int = MAX_SIDE,
    multiple: int = SIZE_MULTIPLE,
    field: str = "size",
) -> tuple[int, int]:
    """``"1024x768"`` as ``(1024, 768)``: each side a positive multiple of ``multiple``
    within ``min_side..max_side``. Raises ``ImageError`` naming ``field``."""
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise ImageError(field, f"{size!r} is not WIDTHxHEIGHT (e.g. '1024x1024')")
    width, height = int(match[1]), int(match[2])
    check_side(width, "width", min_side=min_side, max_side=max_side, multiple=multiple, field=field)
    check_side(height, "height", min_side=min_side, max_side=max_side, multiple=multiple, field=field)
    return width, height


def check_side(
    value: int,
    name: str,
    *,
    min_side: int = MIN_SIDE,
    max_side: int = MAX_SIDE,
    multiple: int = SIZE_MULTIPLE,
    field: str | None = None,
) -> int:
    """``value`` if it is a valid image side; else ``ImageError`` naming ``field`` (default:
    ``name``), e.g. ``"width must be a multiple of 16, got 1000"``."""
    blame = field or name
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ImageError(blame, f"{name} must be a positive integer, got {value!r}")
    if not min_side <= value <= max_side:
        raise ImageError(blame, f"{name} must be between {min_side} and {max_side}, got {value}")
    if value % multiple:
        raise ImageError(blame, f"{name} must be a multiple of {multiple}, got {value}")
    return value


def fit_size(
    width: int,
    height: int,
    *,
    min_side: int = MIN_SIDE,
    max_side: int = MAX_SIDE,
    multiple: int = SIZE_MULTIPLE,
) -> tuple[int, int]:
    """A valid output size close to ``width`` x ``height``: scaled (keeping the aspect
    ratio) into ``min_side..max_side`` when it falls outside, then each side rounded down
    to a multiple of ``multiple`` (and clamped, for aspect ratios no valid size keeps)."""
    scale = 1.0
    if max(width, height) > max_side:
        scale = max_side / max(width, height)
    elif min(width, height) < min_side:
        scale = min(min_side / min(width, height), max_side / max(width, height))

    def side(value: int) -> int:
        rounded = int(value * scale + 1e-6) // multiple * multiple
        low = -(-min_side // multiple) * multiple
        return max(low, min(max_side // multiple * multiple, rounded))

    return side(width), side(height)
