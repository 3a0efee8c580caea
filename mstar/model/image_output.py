"""A diffusion family's image output: pixels made on the device, encoded in the frontend.

The VAE node turns its decoded image into ``uint8 [H, W, 3]`` pixels where it ran (a GPU does
the clamp, scale and rounding in a few microseconds, and a quarter of the float image's bytes
then cross to the host); ``ImageStream`` in the frontend encodes them in the request's output
format (``output_format`` and ``output_compression`` ride in the request's params, set from
the ``ImageSpec``'s ``model_kwargs`` by ``output_params``).
"""

from __future__ import annotations

import torch

from mstar.contract import OutputEvent, RequestError
from mstar.media.images import OUTPUT_FORMATS, encode_image
from mstar.model.spec import OutputStream, WalkRequest


def to_pixels(image: torch.Tensor) -> torch.Tensor:
    """A decoded image in [-1, 1], ``[3, H, W]`` in any float dtype, as ``uint8 [H, W, 3]`` on
    its own device (float32 arithmetic: the same bytes on every device)."""
    scaled = (image.float().clamp(-1, 1) + 1) * 127.5
    return scaled.round().to(torch.uint8).permute(1, 2, 0).contiguous()


def output_params(model_kwargs: dict) -> dict:
    """The request params of an image's encoding, checked: ``output_format`` (png, jpeg or
    webp; png when absent) and ``output_compression`` (0-100, jpeg and webp only)."""
    fmt = model_kwargs.get("output_format") or "png"
    if fmt not in OUTPUT_FORMATS:
        raise RequestError("output_format", f"must be one of {list(OUTPUT_FORMATS)}, got {fmt!r}")
    compression = model_kwargs.get("output_compression")
    if compression is not None:
        if isinstance(compression, bool) or not isinstance(compression, int) or not 0 <= compression <= 100:
            raise RequestError("output_compression", f"must be an integer from 0 to 100, got {compression!r}")
        if fmt == "png":
            raise RequestError("output_compression", "applies to the jpeg and webp output formats only")
    return {"output_format": fmt, "output_compression": compression}


class ImageStream(OutputStream):
    """One emitted image -> one event holding it encoded. Takes ``uint8 [H, W, 3]`` pixels
    (``to_pixels``), or a float image in [-1, 1], ``[3, H, W]``, converted here."""

    def __init__(self, output_format: str = "png", quality: int | None = None):
        self.output_format = output_format
        self.quality = quality
        self.images = 0

    @classmethod
    def for_request(cls, request: WalkRequest) -> "ImageStream":
        return cls(request.params.get("output_format", "png"), request.params.get("output_compression"))

    @property
    def generated(self) -> int:
        return self.images

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        pixels = value if value.dtype == torch.uint8 else to_pixels(value)
        self.images += 1
        return OutputEvent(modality="image", data=encode_image(pixels.cpu().numpy(), self.output_format,
                                                               self.quality))
