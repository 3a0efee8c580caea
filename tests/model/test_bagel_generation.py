"""BAGEL's generation modules and the pure functions of its flow loop against bagel2 0.0.6, in
float32 on the CPU: a reference ``Bagel`` with only its generation side (no ViT; its language
model a fake whose ``forward_inference`` output depends on the query and on which cache it
attends), so its own ``_forward_flow`` and ``generate_image`` run the CFG combine, the schedule
and the guidance interval."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

from mstar.model.bagel.generation import (
    CfgOptions,
    LatentProjections,
    cfg_active,
    cfg_combine,
    latent_grid,
    latent_position_ids,
    patchify_latent,
    timestep_schedule,
    unpatchify_latent,
)
from tests.support import bagel_reference  # noqa: F401  (makes bagel2 importable: its flash_attn stand-in)

HIDDEN, CHANNELS, MAX_LATENT = 32, 4, 8
TOL = 1e-5


def _bagel2():
    from bagel2 import inferencer
    from bagel2.data import data_utils
    from bagel2.modeling.bagel import bagel
    from bagel2.modeling.bagel.qwen2_navit import Qwen2Config

    return NS(bagel=bagel, data_utils=data_utils, inferencer=inferencer, Qwen2Config=Qwen2Config)


class FakeLLM(nn.Module):
    """Stands in for the MoT LLM: the output state of each query is a fixed nonlinear map of its
    input plus a vector that depends on the cache it attends (one per CFG context)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(16, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)

    def forward_inference(self, packed_query_sequence, past_key_values, **_):
        return NS(packed_query_sequence=torch.tanh(self.mix(packed_query_sequence)) + past_key_values)


def reference_bagel(b2) -> nn.Module:
    torch.manual_seed(0)
    llm = b2.Qwen2Config(hidden_size=HIDDEN, num_attention_heads=2, layer_module="Qwen2MoTDecoderLayer")
    cfg = b2.bagel.BagelConfig(visual_und=False, llm_config=llm, vae_config=NS(downsample=8, z_channels=CHANNELS),
                               max_latent_size=MAX_LATENT)
    ref = b2.bagel.Bagel(FakeLLM(), None, cfg)
    ref.use_moe = False  # the fake takes no MoT routing arguments
    with torch.no_grad():
        for p in ref.parameters():  # llm2vae starts at zero: randomise everything
            p.normal_(0.0, 0.3)
        ref.latent_pos_embed._init_weights()
    return ref.eval()


@pytest.fixture(scope="module")
def b2():
    return _bagel2()


@pytest.fixture(scope="module")
def pair(b2):
    ref = reference_bagel(b2)
    ours = LatentProjections(HIDDEN, CHANNELS, patch_size=2, max_latent_size=MAX_LATENT)
    gen_keys = ("time_embedder.", "vae2llm.", "llm2vae.", "latent_pos_embed.")
    state = {k: v for k, v in ref.state_dict().items() if k.startswith(gen_keys)}
    table = state.pop("latent_pos_embed.pos_embed")  # fixed: made, never loaded
    assert set(state) == set(ours.state_dict())  # the released names, both ways
    ours.load_state_dict(state, strict=True)
    assert torch.equal(table, ours.latent_pos_embed.pos_embed)  # the same fixed table
    return ref, ours.eval()


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


def test_modules(pair):
    ref, ours = pair
    t = torch.tensor([1.0, 0.7, 0.25, 0.0])
    pos = torch.tensor([0, 9, 17, 63])
    x = torch.randn(4, 4 * CHANNELS, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        check("time_embedder", ours.time_embedder(t), ref.time_embedder(t))
        want = ref.vae2llm(x) + ref.time_embedder(t) + ref.latent_pos_embed(pos)
        check("embed", ours.embed(x, t, pos), want)
        check("velocity", ours.velocity(want), ref.llm2vae(want))


@pytest.mark.parametrize("size", [(64, 48), (48, 80), (32, 32)])
def test_patchify_and_positions(b2, size):
    height, width = size
    h, w = latent_grid(height, width)
    latent = torch.randn(CHANNELS, 2 * h + 1, 2 * w, generator=torch.Generator().manual_seed(h * w))
    want = b2.data_utils.patchify(latent[:, : 2 * h, : 2 * w], 2)
    tokens = patchify_latent(latent, h, w)
    assert torch.equal(tokens, want)
    # the inferencer's decode_image reshapes tokens back before the VAE decodes them
    seen = {}

    def vae_decode(z: torch.Tensor) -> torch.Tensor:
        seen["z"] = z
        return torch.zeros(1, 3, 1, 1)

    fake = NS(model=NS(latent_downsample=16, latent_patch_size=2, latent_channel=CHANNELS),
              vae_model=NS(decode=vae_decode))
    b2.inferencer.InterleaveInferencer.decode_image(fake, tokens, (height, width))
    assert torch.equal(unpatchify_latent(tokens, h, w), seen["z"][0])
    for interpolate, fn in ((False, b2.data_utils.get_flattened_position_ids_extrapolate),
                            (True, b2.data_utils.get_flattened_position_ids_interpolate)):
        assert torch.equal(latent_position_ids(h, w, MAX_LATENT, interpolate), fn(height, width, 16, MAX_LATENT))


def test_position_ids_beyond_the_table():
    with pytest.raises(ValueError, match="exceeds"):
        latent_position_ids(3, MAX_LATENT + 1, MAX_LATENT)


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("interval", [(0.4, 1.0), (0.0, 0.5)])
def test_schedule_and_interval(pair, shift, interval):
    """bagel2's generate_image with its _forward_flow replaced by a recorder: the times it is
    called at, the guidance scales it gets, and the Euler steps it takes."""
    ref, _ = pair
    calls = []

    def flow(x_t, timestep, cfg_text_scale, cfg_img_scale, **_):
        calls.append((float(timestep[0]), cfg_text_scale, cfg_img_scale))
        return torch.full_like(x_t, float(timestep[0])) + 0.5

    x0 = torch.randn(6, 4 * CHANNELS, generator=torch.Generator().manual_seed(2))
    ref._forward_flow = flow
    try:
        (want,) = ref.generate_image(
            packed_text_ids=None, packed_text_indexes=None, packed_init_noises=x0, packed_vae_position_ids=None,
            packed_vae_token_indexes=None, packed_seqlens=torch.tensor([8]), packed_position_ids=None,
            packed_indexes=None, past_key_values=None, key_values_lens=None, packed_key_value_indexes=None,
            num_timesteps=7, timestep_shift=shift, cfg_interval=interval, cfg_text_scale=4.0, cfg_img_scale=1.5)
    finally:
        del ref._forward_flow
    ts, dts = timestep_schedule(7, shift)
    assert [c[0] for c in calls] == ts.tolist()
    assert [c[1] == 4.0 and c[2] == 1.5 for c in calls] == [cfg_active(float(t), interval) for t in ts]
    x = x0
    for t, dt in zip(ts, dts):
        x = x - (torch.full_like(x, float(t)) + 0.5) * dt
    check("euler", x, want)


def test_schedule_needs_a_step():
    with pytest.raises(ValueError, match="no step"):
        timestep_schedule(1)


CASES = [
    ("global", 4.0, 1.0, 0.0), ("global", 4.0, 1.5, 0.0), ("global", 3.0, 2.0, 0.8),
    ("channel", 4.0, 1.5, 0.0), ("channel", 2.5, 1.0, 0.3),
    ("text_channel", 4.0, 1.5, 0.0), ("text_channel", 4.0, 1.0, 0.5),
    ("global", 1.0, 2.0, 0.0),  # no text guidance: no guidance at all, as in bagel2
]


@pytest.mark.parametrize(("renorm", "text_scale", "img_scale", "renorm_min"), CASES)
def test_cfg_combine(pair, renorm, text_scale, img_scale, renorm_min):
    """bagel2's _forward_flow over three fake caches against our velocities + cfg_combine."""
    ref, ours = pair
    n = 6
    gen = torch.Generator().manual_seed(3)
    caches = {name: torch.randn(HIDDEN, generator=gen) * 2 for name in ("full", "no_text", "no_img")}
    x_t = torch.randn(n, 4 * CHANNELS, generator=gen)
    t = torch.full((n,), 0.6)
    pos = torch.arange(n) + 3
    text_ids, text_idx, vae_idx = torch.tensor([1, 2]), torch.tensor([0, n + 1]), torch.arange(1, n + 1)
    with torch.no_grad():
        want = ref._forward_flow(
            x_t=x_t, timestep=t, packed_vae_token_indexes=vae_idx, packed_vae_position_ids=pos,
            packed_text_ids=text_ids, packed_text_indexes=text_idx, packed_indexes=None, packed_position_ids=None,
            packed_seqlens=torch.tensor([n + 2]), key_values_lens=None, past_key_values=caches["full"],
            packed_key_value_indexes=None, cfg_renorm_min=renorm_min, cfg_renorm_type=renorm,
            cfg_text_scale=text_scale, cfg_text_past_key_values=caches["no_text"],
            cfg_img_scale=img_scale, cfg_img_past_key_values=caches["no_img"])
        seq = torch.zeros(n + 2, HIDDEN)
        seq[text_idx] = ref.language_model.model.embed_tokens(text_ids)
        seq[vae_idx] = ours.embed(x_t, t, pos)
        v = {name: ours.velocity(ref.language_model.forward_inference(seq, cache).packed_query_sequence[vae_idx])
             for name, cache in caches.items()}
        got = cfg_combine(v["full"], v["no_text"], v["no_img"], text_scale, img_scale, renorm, renorm_min)
    check(f"cfg {renorm} text {text_scale} img {img_scale} min {renorm_min}", got, want)


def test_cfg_options_name_a_bad_renorm_type():
    with pytest.raises(ValueError, match="cfg_renorm_type 'norm'"):
        CfgOptions(renorm_type="norm")
