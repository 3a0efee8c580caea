"""Parity of ``Flux2VAE`` and the FLUX.2 latent packing with diffusers 0.42.1
(``AutoencoderKLFlux2`` and the ``Flux2KleinPipeline`` helpers).

Tiny random config in fp32 on CPU: two stages (8, 16 channels, so a 2x VAE), one ResNet per
stage, 4 latent channels (16 after 2x2 patchify), 4 GroupNorm groups. Weights and batch-norm
statistics are random (seeded) and loaded into ours strictly.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from diffusers import AutoencoderKLFlux2
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

from mstar.model.flux2.vae import (
    Flux2VAE,
    Flux2VAEConfig,
    from_tokens,
    pack_latents,
    patchify_latents,
    to_tokens,
    token_grid,
    unpack_latents,
    unpatchify_latents,
)

TOL = 1e-5
TINY = {
    "block_out_channels": (8, 16),
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "layers_per_block": 1,
    "latent_channels": 4,
    "norm_num_groups": 4,
}
Pipe = Flux2KleinPipeline  # its latent helpers are static methods (shared with Flux2Pipeline)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def models() -> tuple[AutoencoderKLFlux2, Flux2VAE]:
    torch.manual_seed(0)
    ref = AutoencoderKLFlux2(**TINY).eval()
    with torch.no_grad():
        for p in ref.parameters():  # default init leaves biases / norms trivial: randomise all
            p.normal_(0.0, 0.2)
        ref.bn.running_mean.normal_()
        ref.bn.running_var.uniform_(0.5, 2.0)
    ours = Flux2VAE(Flux2VAEConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1


def test_state_dict_keys_and_shapes_match_full_size() -> None:
    with torch.device("meta"):
        ref = AutoencoderKLFlux2()
        ours = Flux2VAE()
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want


def test_config_defaults_match_diffusers() -> None:
    params = inspect.signature(AutoencoderKLFlux2.__init__).parameters
    defaults = {k: p.default for k, p in params.items() if k != "self"}
    assert Flux2VAEConfig.from_dict(defaults) == Flux2VAEConfig()
    assert Flux2VAEConfig().scale_factor == 8


def test_encode_parity(models, images) -> None:
    ref, ours = models
    with torch.no_grad():
        want = ref.encode(images).latent_dist.mode()
        got = ours.encode(images)
    assert got.shape == want.shape == (2, 4, 16, 16)
    err = rel_err(got, want)
    print(f"[flux2 vae] encode: max rel err {err:.2e}")
    assert err <= TOL


def test_decode_parity(models) -> None:
    ref, ours = models
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref.decode(latents).sample
        got = ours.decode(latents)
    assert got.shape == want.shape == (2, 3, 32, 32)
    err = rel_err(got, want)
    print(f"[flux2 vae] decode: max rel err {err:.2e}")
    assert err <= TOL


def test_patchify_and_tokens_match_pipeline_helpers() -> None:
    x = torch.randn(2, 4, 6, 10)
    patched = patchify_latents(x)
    assert torch.equal(patched, Pipe._patchify_latents(x))
    assert torch.equal(unpatchify_latents(patched), Pipe._unpatchify_latents(patched))
    assert torch.equal(unpatchify_latents(patched), x)
    tokens = to_tokens(patched)
    assert torch.equal(tokens, Pipe._pack_latents(patched))
    ids = Pipe._prepare_latent_ids(patched)
    assert torch.equal(from_tokens(tokens, 3, 5), Pipe._unpack_latents_with_ids(tokens, ids, 3, 5))
    assert torch.equal(from_tokens(tokens, 3, 5), patched)


def test_pack_matches_pipeline_image_encoding(models, images) -> None:
    """``pack_latents(encode(x))`` equals the pipeline's ``_encode_vae_image`` (patchify +
    batch-norm normalisation) followed by ``_pack_latents``."""
    ref, ours = models
    fake_pipe = SimpleNamespace(vae=ref, _patchify_latents=Pipe._patchify_latents)
    with torch.no_grad():
        want = Pipe._pack_latents(Pipe._encode_vae_image(fake_pipe, images, None))
        got = pack_latents(ours.encode(images), *ours.latent_norm())
    assert got.shape == want.shape == (2, 64, 16)
    err = rel_err(got, want)
    print(f"[flux2 vae] encode + pack: max rel err {err:.2e}")
    assert err <= TOL


def test_unpack_matches_pipeline_output_path(models) -> None:
    """``unpack_latents`` equals the tail of ``Flux2KleinPipeline.__call__`` (scatter by position
    ids, undo the batch-norm normalisation, unpatchify), rebuilt here from its helpers."""
    ref, ours = models
    rows, cols = 3, 5
    tokens = torch.randn(2, rows * cols, 16)
    ids = Pipe._prepare_latent_ids(torch.zeros(2, 16, rows, cols))
    want = Pipe._unpack_latents_with_ids(tokens, ids, rows, cols)
    mean = ref.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(ref.bn.running_var.view(1, -1, 1, 1) + ref.config.batch_norm_eps)
    want = Pipe._unpatchify_latents(want * std + mean)
    got = unpack_latents(tokens, rows, cols, *ours.latent_norm())
    assert got.shape == (2, 4, 2 * rows, 2 * cols)
    assert torch.equal(got, want)


def test_pack_unpack_round_trip(models) -> None:
    _, ours = models
    latents = torch.randn(3, 4, 8, 12)
    mean, std = ours.latent_norm()
    tokens = pack_latents(latents, mean, std)
    assert tokens.shape == (3, 4 * 6, 16)
    back = unpack_latents(tokens, 4, 6, mean, std)
    torch.testing.assert_close(back, latents, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        unpack_latents(tokens, 5, 6, mean, std)


@pytest.mark.parametrize("size", [(1024, 1024), (768, 1360), (500, 700), (64, 48)])
def test_token_grid_matches_prepare_latents(size: tuple[int, int]) -> None:
    height, width = size
    fake_pipe = SimpleNamespace(
        vae_scale_factor=8,
        _prepare_latent_ids=Pipe._prepare_latent_ids,
        _pack_latents=Pipe._pack_latents,
    )
    generator = torch.Generator().manual_seed(0)
    _, ids = Pipe.prepare_latents(fake_pipe, 1, 32, height, width, torch.float32, "cpu", generator)
    rows, cols = token_grid(height, width)
    assert ids.shape[1] == rows * cols
    assert ids[0, -1, 1].item() == rows - 1 and ids[0, -1, 2].item() == cols - 1
