"""FLUX.2 [klein]'s whole-image fast path (issue 6, S2): pixels made on the device, fast
image encoding in the request's output format, a text encoder free of host syncs (and
replayed from CUDA graphs), position ids made once. On the CPU: each piece against the
eager formula it replaces, exactly. On a GPU: the whole tiny pipeline in bf16 with every
fast-path knob on against the eager pipeline, and the text encoder and DiT steps running
without a single host sync. Uses the tiny checkpoint of test_flux2_klein_walk."""

import asyncio
import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image
from test_flux2_klein_walk import randomize, reference  # noqa: F401  (the tiny checkpoint fixture)

from mstar.config import parse_config
from mstar.contract import ImageSpec, RequestError
from mstar.engine.base import EngineItem
from mstar.media import images as media
from mstar.model.flux2.knobs import Flux2Knobs
from mstar.model.flux2.positions import DeviceIds, text_ids, token_ids
from mstar.model.flux2.text import KleinText
from mstar.model.image_output import ImageStream, output_params, to_pixels
from mstar.model.qwen3 import attention_mask_4d
from mstar.model.registry import model_class
from mstar.runtime.launch import start
from tests.support.markers import needs_cuda


def decoded(data: bytes) -> tuple[str, np.ndarray]:
    with Image.open(io.BytesIO(data)) as image:
        return image.format, np.asarray(image.convert("RGB"))


def old_pixels(image: torch.Tensor) -> np.ndarray:
    """The frontend's former conversion of a float image, on the host."""
    return ((image.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()


# ------------------------------------------------------------------- pixels and encoding
def test_device_pixels_equal_the_host_conversion():
    g = torch.Generator().manual_seed(0)
    image = torch.randn(3, 20, 28, generator=g) * 1.5  # beyond [-1, 1] too
    image[0, 0, :5] = torch.tensor([-1.0, 1.0, 0.0, 1 / 255, -3.0])  # edges and a .5 rounding case
    for dtype in (torch.float32, torch.bfloat16):
        pixels = to_pixels(image.to(dtype))
        assert pixels.dtype == torch.uint8 and pixels.shape == (20, 28, 3) and pixels.is_contiguous()
        assert np.array_equal(pixels.numpy(), old_pixels(image.to(dtype)))


def test_png_is_lossless():
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    fmt, back = decoded(media.encode_image(pixels))
    assert fmt == "PNG" and np.array_equal(back, pixels)


def test_image_stream_encodes_the_requested_format():
    g = torch.Generator().manual_seed(3)
    image = torch.rand(3, 32, 48, generator=g) * 2 - 1
    y, x = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 48), indexing="ij")
    smooth = torch.stack([x, y, x * y])
    for value in (image, to_pixels(image)):  # float images still work (as a family may emit them)
        fmt, back = decoded(ImageStream().feed("image", value).data)
        assert fmt == "PNG" and np.array_equal(back, old_pixels(image))
    sizes = {}
    for fmt, quality in (("jpeg", 95), ("jpeg", 10), ("webp", 90)):
        data = ImageStream(fmt, quality).feed("image", to_pixels(smooth)).data
        kind, back = decoded(data)
        assert kind == fmt.upper() and back.shape == (32, 48, 3)
        assert np.abs(back.astype(int) - old_pixels(smooth)).mean() < (4 if quality > 50 else 12)
        sizes[fmt, quality] = len(data)
    assert sizes["jpeg", 10] < sizes["jpeg", 95]


@pytest.mark.parametrize("kwargs, field", [
    ({"output_format": "gif"}, "output_format"),
    ({"output_format": "png", "output_compression": 5}, "output_compression"),
    ({"output_format": "jpeg", "output_compression": 101}, "output_compression"),
    ({"output_format": "webp", "output_compression": True}, "output_compression"),
])
def test_bad_output_encoding_names_the_field(kwargs, field):
    with pytest.raises(RequestError) as err:
        output_params(kwargs)
    assert err.value.field == field
    assert output_params({}) == {"output_format": "png", "output_compression": None}


def test_klein_serves_jpeg(reference):  # noqa: F811
    d = start(parse_config({"model": "flux2_klein", "model_path": str(reference[0]),
                            "model_kwargs": {"max_image_area": 64 * 64}}), in_process=True)
    try:
        spec = ImageSpec("j", "a red kite", 64, 32, 1, 5, 2)
        [png] = asyncio.run(d.backend.generate_images(spec))
        jpeg_kwargs = {"output_format": "jpeg", "output_compression": 90}
        spec = dataclasses.replace(spec, request_id="j2", model_kwargs=jpeg_kwargs)
        [jpeg] = asyncio.run(d.backend.generate_images(spec))
    finally:
        d.close()
    (png_kind, pixels), (jpeg_kind, got) = decoded(png), decoded(jpeg)
    assert (png_kind, jpeg_kind) == ("PNG", "JPEG") and got.shape == pixels.shape == (32, 64, 3)
    assert jpeg == media.encode_image(pixels, "jpeg", 90)  # the same image (same seed), encoded as asked


# ------------------------------------------------------------------- text encoder, ids
def test_text_encoder_takes_padding_from_the_host(reference):  # noqa: F811
    """KleinText.encode reads "is anything padded" on the host and passes it down, so the
    forward never reads the device mask; the features equal the former call's exactly."""
    text = KleinText.from_directory(reference[0])
    encoder = text.build_encoder().eval()
    randomize(encoder, 4)
    ids, masks = zip(*(text.tokenize(p) for p in ("a red kite", "two kites over a long and windy beach")))
    got = text.encode(encoder, ids, masks)
    with torch.inference_mode():  # the former path: the device mask, whose all() the forward read
        states = encoder(torch.stack(ids), torch.stack(masks), tap_layers=text.tap_layers)
    want = torch.cat(states, dim=-1)
    assert torch.equal(torch.stack(got), want)
    full = torch.ones(2, 5, dtype=torch.long)
    assert attention_mask_4d(full, 5) is None and attention_mask_4d(full, 5, padded=False) is None
    assert attention_mask_4d(full, 5, padded=True).all(dim=(0, 1)).equal(torch.ones(5, 5).tril().bool())


def test_cuda_graphs_knob_is_checked():
    assert Flux2Knobs.parse({"cuda_graphs": True}, device="cuda").cuda_graphs is True
    with pytest.raises(ValueError, match="model_kwargs.cuda_graphs"):
        Flux2Knobs.parse({"cuda_graphs": "yes"}, device="cuda")


def test_cuda_graphs_need_a_cuda_device(reference):  # noqa: F811
    """Refused when the spec is made (startup, before any weights load), not when the encoder is."""
    with pytest.raises(ValueError, match="model_kwargs.cuda_graphs needs device: cuda"):
        model_class("flux2_klein")(parse_config({"model": "flux2_klein", "model_path": str(reference[0]),
                                                 "model_kwargs": {"cuda_graphs": True}}))


def test_position_ids_are_made_once_per_layout():
    ids = DeviceIds(torch.device("cpu"))
    params = [{"rows": 2, "cols": 4}, {"rows": 2, "cols": 3, "reference_grids": [[1, 2]]}]  # 8 tokens each
    image, text = ids(params, 7)
    assert torch.equal(image[0], token_ids(params[0])) and torch.equal(image[1], token_ids(params[1]))
    assert torch.equal(text, text_ids(7))
    again = ids([dict(p, num_steps=4) for p in params], 7)  # other params, same layout: the same tensors
    assert again[0] is image and again[1] is text
    assert ids(params[:1], 7)[0] is not image


# ---------------------------------------------------------------------------- the GPU
def _deployment(root, dtype="bfloat16", **kwargs):
    return start(parse_config({"model": "flux2_klein", "model_path": str(root), "device": "cuda",
                               "dtype": dtype, "model_kwargs": {"max_image_area": 128 * 128, **kwargs}}),
                 in_process=True)


def _images(d, seeds):
    out = []
    for seed in seeds:
        [png] = asyncio.run(d.backend.generate_images(ImageSpec(f"g{seed}", "a red kite", 128, 96, 1, seed, 4)))
        out.append(decoded(png)[1].astype(np.int16))
    return out


def _run(root, seeds, warm=False, **kwargs):
    d = _deployment(root, **kwargs)
    try:
        if warm:
            _images(d, (7,))  # warm-up: compile, capture
        return _images(d, seeds)
    finally:
        d.close()


@needs_cuda
def test_fast_path_images_equal_eager_on_the_gpu(reference):  # noqa: F811
    """The whole tiny pipeline in bf16 on CUDA with every fast-path knob on (text encoder in
    CUDA graphs, DiT and VAE decode compiled by inductor, cuDNN attention, the fused QK-norm +
    RoPE kernel) against the eager bf16 pipeline, both measured against the same pipeline run
    eagerly in float32 (the exact answer, up to fp32 rounding), same seeds. The tolerance is
    the eager path's own: the fast path may be no further from float32 than twice eager bf16
    is (mean and largest pixel difference), plus one level. Inductor's fused kernels round
    intermediates differently from eager's, and a tiny random DiT carries that through four
    Euler steps and the VAE, so the two bf16 images need not agree to a level; what must hold is
    that the fast path is as good an approximation as eager bf16. A bug (a wrong mask, stale
    graph inputs, a mis-laid tensor) lands far outside that."""
    root = reference[0]
    seeds = (1, 2)
    exact = _run(root, seeds, dtype="float32")
    eager = _run(root, seeds)
    fast = _run(root, seeds, warm=True, cuda_graphs=True, compile=True, vae_compile=True, attention_backend="cudnn",
                fused_kernels=True)
    for x, e, f in zip(exact, eager, fast):
        assert x.std() > 5  # an image, not a flat field
        eager_err, fast_err = np.abs(e - x), np.abs(f - x)
        assert fast_err.mean() <= 2 * eager_err.mean() + 1, (fast_err.mean(), eager_err.mean())
        assert fast_err.max() <= 2 * eager_err.max() + 1, (fast_err.max(), eager_err.max())


@needs_cuda
def test_graphed_text_encoder_equals_eager_and_never_syncs(reference):  # noqa: F811
    """The text encoder replayed from CUDA graphs gives eager's features bit for bit (the
    same kernels), one graph per (batch, length, padded); once warm, neither it nor the DiT
    steps make the host wait for the GPU (torch's sync debug mode turns any wait into an
    error), so the host can queue a whole image's work ahead of the GPU."""
    root = reference[0]
    spec = model_class("flux2_klein")(parse_config({"model": "flux2_klein", "model_path": str(root), "device": "cuda",
                                                    "dtype": "bfloat16", "model_kwargs": {"cuda_graphs": True}}))
    engines = spec.build_engines({"text_encoder", "dit"}, torch.device("cuda"))
    text = KleinText.from_directory(root)
    eager = model_class("flux2_klein")(parse_config({"model": "flux2_klein", "model_path": str(root), "device": "cuda",
                                                     "dtype": "bfloat16"})).build_engines(
        {"text_encoder"}, torch.device("cuda"))["text_encoder"]
    prompts = [text.tokenize(p) for p in ("a red kite", "two kites over a long and windy beach")]

    def items(rows):
        return [EngineItem(f"t{i}", "encode", 0, {"prompt_ids": ids, "prompt_mask": mask}, {})
                for i, (ids, mask) in enumerate(rows)]

    for rows in (prompts[:1], prompts):
        want = eager.run(items(rows))
        engines["text_encoder"].run(items(rows))  # capture
        got = engines["text_encoder"].run(items(rows))
        for w, g in zip(want, got):
            assert torch.equal(g.outputs["text"], w.outputs["text"])
    g = torch.Generator().manual_seed(0)
    params = {"num_steps": 2, "image_seq_len": 6, "rows": 2, "cols": 3}
    steps = [EngineItem("d", "step", i, {"latents": torch.randn(6, 16, generator=g), "text": got[0].outputs["text"]},
                        params) for i in range(2)]
    engines["dit"].run(steps[:1])  # warm-up (first-use initialisation may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engines["text_encoder"].run(items(prompts))
        engines["dit"].run(steps[1:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
