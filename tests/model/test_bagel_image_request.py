"""How an image request becomes BAGEL's generate / edit walk: defaults (BAGEL's demo), the
request's options, seeded noise, the edit's inputs, and 400s that name the field."""

from __future__ import annotations

import pytest
import torch

from mstar.contract import ImageSpec, RequestError
from mstar.model.bagel.image_request import LatentShape, image_request, vae_pixels

SHAPE = LatentShape(channels=4, patch=2, downsample=16, max_latent_size=8)


def spec(**kw) -> ImageSpec:
    return ImageSpec("r", kw.pop("prompt", "a cat"), **{"width": 64, "height": 48, **kw})


def test_generate_defaults_and_seeded_noise():
    req = image_request(spec(seed=3), [5, 6], SHAPE)
    assert req.walk == "generate"
    p = req.params
    assert (p["height"], p["width"], p["num_timesteps"], p["num_steps"]) == (48, 64, 50, 49)
    assert (p["cfg_text_scale"], p["cfg_img_scale"], p["cfg_interval"], p["cfg_renorm_type"], p["cfg_renorm_min"],
            p["timestep_shift"]) == (4.0, 1.5, (0.4, 1.0), "global", 1.0, 3.0)
    assert req.inputs["latents"].shape == (3 * 4, 16)
    again = image_request(spec(seed=3), [5, 6], SHAPE)
    assert torch.equal(req.inputs["latents"], again.inputs["latents"])
    other = image_request(spec(seed=3), [5, 6], SHAPE, index=1)
    assert not torch.equal(req.inputs["latents"], other.inputs["latents"])


def test_options():
    kwargs = {"cfg_img_scale": 1.0, "cfg_interval": [0.1, 0.9], "cfg_renorm_type": "channel", "cfg_renorm_min": 0.0,
              "timestep_shift": 1.0, "output_format": "webp"}
    p = image_request(spec(guidance_scale=2.5, num_inference_steps=10, model_kwargs=kwargs), [5], SHAPE).params
    assert (p["cfg_text_scale"], p["cfg_img_scale"], p["cfg_interval"], p["cfg_renorm_type"], p["cfg_renorm_min"],
            p["timestep_shift"], p["num_steps"], p["output_format"]) == (2.5, 1.0, (0.1, 0.9), "channel", 0.0, 1.0,
                                                                        9, "webp")


def test_edit_keeps_the_image_size():
    image = torch.rand(3, 32, 48) * 2 - 1
    vit = torch.rand(3, 28, 42) * 2 - 1
    req = image_request(spec(seed=1), [5], SHAPE, edit_image=image, vit_image=vit, vit_patch=14, vit_max_side=70)
    assert req.walk == "edit"
    assert (req.params["height"], req.params["width"], req.params["cfg_renorm_type"]) == (32, 48, "text_channel")
    assert req.inputs["latents"].shape == (2 * 3, 16) and req.inputs["image_noise"].shape == (4, 4, 6)
    assert req.inputs["patches"].shape == (6, 14 * 14 * 3) and req.inputs["patch_counts"].tolist() == [6]


@pytest.mark.parametrize(("kw", "field"), [
    (dict(width=50), "size"), (dict(width=16 * 9), "size"), (dict(num_inference_steps=1), "num_inference_steps"),
    (dict(guidance_scale=-1.0), "guidance_scale"), (dict(model_kwargs={"cfg_interval": [0.8, 0.2]}), "cfg_interval"),
    (dict(model_kwargs={"cfg_renorm_type": "norm"}), "cfg_renorm_type"),
    (dict(model_kwargs={"cfg_scale": 2}), "model_kwargs"),
])
def test_bad_requests_name_the_field(kw, field):
    with pytest.raises(RequestError) as err:
        image_request(spec(**kw), [5], SHAPE)
    assert err.value.field == field


def test_empty_prompt():
    with pytest.raises(RequestError, match="must not be empty"):
        image_request(spec(), [], SHAPE)


def test_vae_pixels_resizes_to_multiples_of_16():
    from PIL import Image

    image = Image.new("RGB", (300, 200), (255, 0, 0))
    pixels = vae_pixels(image)
    assert pixels.shape == (3, 512, 768)  # the short side up to 512, both multiples of 16
    assert torch.allclose(pixels[:, 0, 0], torch.tensor([1.0, -1.0, -1.0]))
