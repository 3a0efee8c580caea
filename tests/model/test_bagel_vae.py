"""BAGEL's VAE (``ZImageVAE`` loaded from ``ae.safetensors``' original FLUX.1 key layout) against
bagel2 0.0.6's ``AutoEncoder``: a tiny random config (two resolutions of 32 and 64 channels: the
original hard-codes 32 GroupNorm groups; one ResNet block per stage; 4 latent channels) in float32
on the CPU, written to a safetensors file with the reference's own state dict and loaded with
coverage checked both ways."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mstar.model.bagel.vae import decode, encode, flux1_vae_config, from_original_layout
from mstar.model.weights import WeightLoadError, iter_safetensors, load_weights
from mstar.model.z_image.vae import ZImageVAE
from tests.support import bagel_reference  # noqa: F401  (makes bagel2 importable: its flash_attn stand-in)

TOL = 1e-5
PARAMS = dict(ch=32, ch_mult=[1, 2], num_res_blocks=1, z_channels=4, scale_factor=0.3611, shift_factor=0.1159)


def _reference():
    from bagel2.modeling import autoencoder

    return autoencoder


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ae = _reference()
    ref = ae.AutoEncoder(ae.AutoEncoderParams(resolution=32, in_channels=3, downsample=2, out_ch=3, **PARAMS))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in ref.named_parameters():  # the default init leaves norms and biases trivial
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if ".norm" in name and p.ndim == 1 else 0.2 * noise)
    path = tmp_path_factory.mktemp("bagel") / "ae.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    config = flux1_vae_config(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4)
    ours = ZImageVAE(config).eval()
    load_weights(ours, from_original_layout(iter_safetensors(path.parent), levels=2))
    return ref.eval(), ours


def test_defaults_are_bagels_load_ae():
    cfg = flux1_vae_config()
    assert cfg.net.block_out_channels == (128, 256, 512, 512) and cfg.net.latent_channels == 16
    assert (cfg.scaling_factor, cfg.shift_factor, cfg.scale_factor) == (0.3611, 0.1159, 8)
    ae = _reference()
    with torch.device("meta"):
        ref, _ = ae.load_ae(None)
        ours = ZImageVAE(cfg)
    got = {k: tuple(v.shape) for k, v in from_original_layout(ref.state_dict().items(), levels=4)}
    assert got == {k: tuple(v.shape) for k, v in ours.state_dict().items()}


def test_encode_mean(pair):
    ref, ours = pair
    ref.reg.sample = False
    images = torch.rand(2, 3, 32, 24, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        check("encode (mean)", encode(ours, images), ref.encode(images))


def test_encode_sample(pair):
    ref, ours = pair
    ref.reg.sample = True  # BAGEL's default: editing encodes a posterior sample
    images = torch.rand(1, 3, 16, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        torch.manual_seed(7)
        want = ref.encode(images)
        torch.manual_seed(7)
        noise = torch.randn(1, 4, 8, 16)
        check("encode (sample)", encode(ours, images, noise), want)
        assert (want - ref.encode(images)).abs().max() > 1e-3  # the sample really is random


def test_decode(pair):
    ref, ours = pair
    latents = torch.randn(2, 4, 6, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        check("decode", decode(ours, latents), ref.decode(latents))


def test_coverage_both_ways(pair):
    ref, _ = pair
    tensors = dict(ref.state_dict())
    ours = ZImageVAE(flux1_vae_config(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4))
    missing = {k: v for k, v in tensors.items() if k != "decoder.up.0.block.1.conv2.bias"}
    with pytest.raises(WeightLoadError, match=r"did not fill .*decoder\.up_blocks\.1\.resnets\.1\.conv2\.bias"):
        load_weights(ours, from_original_layout(missing.items(), levels=2))
    extra = {**tensors, "encoder.down.0.attn.0.q.weight": torch.zeros(32, 32, 1, 1)}
    with pytest.raises(WeightLoadError, match=r"nothing loads .*encoder\.down\.0\.attn\.0\.q\.weight"):
        load_weights(ours, from_original_layout(extra.items(), levels=2))


def test_decode_engine(pair):
    """The VAE node: latent tokens of two sizes -> pixels, as bagel2's inferencer unpacks them
    (``decode_image``) and its AutoEncoder decodes them (rounded, where the inferencer truncates)."""
    from mstar.engine.base import EngineItem
    from mstar.model.bagel.generation import patchify_latent
    from mstar.model.bagel.image_engine import vae_decode_engine
    from mstar.model.image_output import to_pixels

    ref, ours = pair
    engine = vae_decode_engine(ours, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(4)
    # the tiny VAE downsamples 2x, so a 2x2-patched token covers 4 pixels: (height, width) / 4 tokens
    sizes = [(8, 12), (8, 12), (12, 4)]
    latents = [torch.randn(4, h // 2, w // 2, generator=gen) for h, w in sizes]
    items = [EngineItem(str(i), "decode", 0, {"latents": patchify_latent(z, h // 4, w // 4)},
                        {"height": h, "width": w}) for i, (z, (h, w)) in enumerate(zip(latents, sizes))]
    outs = engine.run(items)
    with torch.no_grad():
        for z, out in zip(latents, outs):
            assert torch.equal(out.outputs["image"], to_pixels(ref.decode(z[None])[0]))


def test_config_from_shapes_of_bagels_ae():
    from mstar.model.bagel.vae import config_from_shapes

    with torch.device("meta"):
        full, _ = _reference().load_ae(None)
    assert config_from_shapes({k: v.shape for k, v in full.state_dict().items()}) == flux1_vae_config()
    with pytest.raises(ValueError, match="not a FLUX autoencoder"):
        config_from_shapes({"encoder.conv_in.weight": (32, 3, 3, 3)})


def test_load_generation_side(pair, tmp_path):
    """The generator's modules from ``ema.safetensors`` (other parts' tensors skipped) and the
    VAE from ``ae.safetensors``, its shape read off the file; dummy weights without a file."""
    from types import SimpleNamespace as NS

    from mstar.model.bagel.generation import LatentProjections
    from mstar.model.bagel.image_engine import load_generation_side
    from mstar.model.bagel.vision import sincos_table

    ref, _ = pair
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "ae.safetensors")
    source = LatentProjections(32, 4, 2, 8)
    with torch.no_grad():
        for p in source.parameters():
            p.normal_()
    ema = {**source.state_dict(), "language_model.lm_head.weight": torch.zeros(3, 32)}
    ckpt = NS(path=tmp_path, tensors=lambda: iter(ema.items()))
    config = NS(llm=NS(hidden_size=32), latent_patch_size=2, max_latent_size=8)
    proj, vae = load_generation_side(ckpt, config, torch.device("cpu"), torch.float32, dummy=False, seed=0)
    assert all(torch.equal(proj.state_dict()[k], v) for k, v in source.state_dict().items())
    images = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(5)) * 2 - 1
    ref.reg.sample = False
    with torch.no_grad():
        check("loaded vae encode", encode(vae, images), ref.encode(images))

    empty = tmp_path / "dummy"
    empty.mkdir()
    proj, vae = load_generation_side(NS(path=empty), config, torch.device("meta"), torch.float32, dummy=True, seed=0)
    assert vae.config == flux1_vae_config()
    proj, _ = load_generation_side(NS(path=tmp_path), config, torch.device("cpu"), torch.float32, dummy=True, seed=0)
    assert torch.equal(proj.latent_pos_embed.pos_embed, sincos_table(8, 32))
    assert proj.vae2llm.weight.abs().sum() > 0
