"""Image generation for ``MStarClient``: ``generate_image`` (/v1/images/generations) and
``edit_image`` (/v1/images/edits), as a mixin. Both return PNG bytes (a list with n > 1).

    >>> png = client.generate_image("a lighthouse at dusk", width=768, height=512, seed=7)
    >>> Path("out.png").write_bytes(png)
    >>> edited = client.edit_image("make it snowy", "out.png")
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

ImageInput = str | PathLike[str] | bytes  # a path, or the file's bytes
MAX_IMAGES = 4  # reference images per edit


def _image_upload(item: ImageInput, index: int) -> tuple[str, bytes]:
    if isinstance(item, (bytes, bytearray)):
        return f"image{index}.png", bytes(item)
    path = Path(item)
    return path.name, path.read_bytes()


def _pngs(raw: dict[str, Any], n: int) -> bytes | list[bytes]:
    """The response's images, decoded: one PNG for n == 1, else a list."""
    pngs = [base64.b64decode(item["b64_json"]) for item in raw.get("data") or []]
    return pngs[0] if n == 1 and len(pngs) == 1 else pngs


def _knobs(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


class ImagesMixin:
    """``MStarClient``'s image methods."""

    if TYPE_CHECKING:  # provided by MStarClient

        def _json(self, method: str, url: str, **kwargs: Any) -> Any: ...

    def generate_image(
        self,
        prompt: str,
        *,
        width: int = 1024,
        height: int = 1024,
        seed: int | None = None,
        n: int = 1,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        model: str | None = None,
    ) -> bytes | list[bytes]:
        """Text to image: PNG bytes, or a list of ``n`` PNGs when ``n > 1``. Sides must be
        multiples of 16 within the server's bounds (256..4096 by default)."""
        body = {
            "prompt": prompt,
            "size": f"{width}x{height}",
            "n": n,
            "response_format": "b64_json",
            **_knobs(seed=seed, num_inference_steps=num_inference_steps,
                     guidance_scale=guidance_scale, model=model),
        }
        return _pngs(self._json("POST", "/v1/images/generations", json=body), n)

    def edit_image(
        self,
        prompt: str,
        image: ImageInput,
        *,
        images: Sequence[ImageInput] | None = None,
        seed: int | None = None,
        width: int | None = None,
        height: int | None = None,
        n: int = 1,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        model: str | None = None,
    ) -> bytes | list[bytes]:
        """Image(s) and text to image. ``image`` (a path or bytes) and the further
        reference ``images`` (at most 4 in all) guide the result; without ``width`` and
        ``height`` the output keeps the first image's size (rounded down to a multiple
        of 16). PNG bytes, or a list of ``n`` PNGs when ``n > 1``."""
        if (width is None) != (height is None):
            raise ValueError("give both width and height, or neither")
        references = [image, *(images or [])]
        if len(references) > MAX_IMAGES:
            raise ValueError(f"at most {MAX_IMAGES} images in all, got {len(references)}")
        form = _knobs(
            prompt=prompt,
            model=model,
            n=n,
            size=f"{width}x{height}" if width is not None else None,
            response_format="b64_json",
            seed=seed,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
        )
        data = {k: str(v) for k, v in form.items()}
        files = [("image[]", _image_upload(item, i)) for i, item in enumerate(references)]
        return _pngs(self._json("POST", "/v1/images/edits", data=data, files=files), n)

