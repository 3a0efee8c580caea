"""A diffusion family's image output: pixels made on the device, encoded in the frontend.

The VAE node turns its decoded image into ``uint8 [H, W, 3]`` pixels where it ran (a GPU does
the clamp, scale and rounding in a few microseconds, and a quarter of the float image's bytes
then cross to the host); ``ImageStream`` in the frontend encodes them in the request's output
format (``output_format`` and ``output_compression`` ride in the request's params, set from
the ``ImageSpec``'s ``model_kwargs`` by ``output_params``, typed by ``ImageOutputKnobs``).
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from mstar.contract import GenerateSpec, ImageSpec, OutputEvent, RequestError
from mstar.media.images import OUTPUT_FORMATS, encode_image
from mstar.model.knobs import RequestKnobs
from mstar.model.spec import OutputStream, WalkRequest


def to_pixels(image: torch.Tensor) -> torch.Tensor:
    """A decoded image in [-1, 1], ``[3, H, W]`` in any float dtype, as ``uint8 [H, W, 3]`` on
    its own device (float32 arithmetic: the same bytes on every device)."""
    scaled = (image.float().clamp(-1, 1) + 1) * 127.5
    return scaled.round().to(torch.uint8).permute(1, 2, 0).contiguous()


class ImageOutputKnobs(RequestKnobs):
    """An image request's encoding, from its ``model_kwargs``."""

    output_format: str | None = None
    """png, jpeg or webp (None: png)."""

    output_compression: int | None = Field(None, ge=0, le=100)
    """0-100, for the jpeg and webp formats only."""

    @field_validator("output_format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        if value is not None and value not in OUTPUT_FORMATS:
            raise ValueError(f"must be one of {list(OUTPUT_FORMATS)}, got {value!r}")
        return value

    def check(self) -> None:
        if self.output_compression is not None and self.output_format in (None, "png"):
            raise RequestError("output_compression", "applies to the jpeg and webp output formats only")

    @property
    def params(self) -> dict:
        """The request params ``ImageStream.for_request`` reads."""
        return {"output_format": self.output_format or "png", "output_compression": self.output_compression}


class ImageGenerateKnobs(ImageOutputKnobs):
    """``/generate``'s ``model_kwargs`` for an image model: the ``ImageSpec`` fields, and the encoding."""

    width: int = Field(1024, ge=1)
    height: int = Field(1024, ge=1)
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None

    def image_spec(self, spec: GenerateSpec) -> ImageSpec:
        """The ``ImageSpec`` of ``spec``: its text is the prompt, its files the reference images."""
        encoding = self.model_dump(include={"output_format", "output_compression"}, exclude_unset=True)
        return ImageSpec(spec.request_id, spec.text, self.width, self.height, 1, self.seed, self.num_inference_steps,
                         self.guidance_scale, [data for _, data in spec.files], encoding)


def output_params(model_kwargs: dict) -> dict:
    """The request params of an image's encoding, checked (``ImageOutputKnobs``)."""
    return ImageOutputKnobs.parse(model_kwargs).params


class ImageStream(OutputStream):
    """One emitted image -> one event holding it encoded. Takes ``uint8 [H, W, 3]`` pixels
    (``to_pixels``), or a float image in [-1, 1], ``[3, H, W]``, converted here."""

    def __init__(self, output_format: str = "png", quality: int | None = None):
        self.output_format = output_format
        self.quality = quality
        self.images = 0

    @classmethod
    def for_request(cls, request: WalkRequest) -> ImageStream:
        return cls(request.params.get("output_format", "png"), request.params.get("output_compression"))

    @property
    def generated(self) -> int:
        return self.images

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        pixels = value if value.dtype == torch.uint8 else to_pixels(value)
        self.images += 1
        return OutputEvent(modality="image", data=encode_image(pixels.cpu().numpy(), self.output_format,
                                                               self.quality))
