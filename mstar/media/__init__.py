"""Media for image models: decoding uploads safely, encoding PNGs, parsing sizes."""

from mstar.media.images import (
    ImageError,
    check_side,
    decode_image,
    encode_png,
    fit_size,
    parse_size,
)

__all__ = ["ImageError", "check_side", "decode_image", "encode_png", "fit_size", "parse_size"]
