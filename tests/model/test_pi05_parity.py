"""Pi0.5 against transformers' ``PI05ForConditionalGeneration`` (5.25) on a tiny random config,
float32 on the CPU: each module, the prefix's hidden states and logits, and whole
``sample_actions`` chunks for fixed noise over several observation sets (one or two cameras,
prompts of different lengths, solo and batched)."""

from __future__ import annotations

import pytest
import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.pi05.config import Pi05Config
from mstar.model.pi05.modeling import Pi05Policy, step_metadata
from mstar.model.weights import load_weights
from tests.support.pi05 import (
    ACTION_DIM,
    CHUNK,
    IMAGE_TOKEN,
    STEPS,
    lerobot_state_dict,
    reference_model,
    tiny_lerobot_config,
)

pytest.importorskip("transformers.models.pi05")

TOL = 1e-5


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def models():
    ref = reference_model(seed=0)
    ours = Pi05Policy(Pi05Config.from_lerobot(tiny_lerobot_config()))
    names = {"paligemma_with_expert.paligemma.lm_head.weight":
             "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight",
             "paligemma_with_expert.gemma_expert.lm_head.weight": None}
    with torch.no_grad():
        load_weights(ours, lerobot_state_dict(ref).items(), name_map=lambda n: names.get(n, n))
    return ref, ours.eval()


def observation(seed: int, cameras: int, text_len: int):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(cameras, 3, 16, 16, generator=g) * 2 - 1
    ids = torch.randint(0, IMAGE_TOKEN, (text_len,), generator=g)
    return pixels, ids


def reference_inputs(observations):
    """Right-padded ids and masks, cameras padded to the most any observation has."""
    tpi = 16
    rows = [torch.cat([torch.full((len(p) * tpi,), IMAGE_TOKEN), ids]) for p, ids in observations]
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, :len(r)], mask[b, :len(r)] = r, 1
    cams = max(len(p) for p, _ in observations)
    pixels = torch.zeros(len(rows), cams, 3, 16, 16)
    pixel_mask = torch.zeros(len(rows), cams, dtype=torch.bool)
    for b, (p, _) in enumerate(observations):
        pixels[b, :len(p)], pixel_mask[b, :len(p)] = p, True
    return input_ids, mask, pixels, pixel_mask


def noise_for(batch: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(batch, CHUNK, ACTION_DIM, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_modules(models):
    ref, ours = models
    pixels, _ = observation(1, 2, 4)
    want = ref.model.vlm.get_image_features(pixels).pooler_output
    assert rel_err(ours.encode_images(pixels), want) < TOL

    t = torch.tensor([1.0, 0.37])
    noise = noise_for(2)
    want_actions, want_time = ref.embed_action_time(noise, t)
    assert rel_err(ours.time_embedding(t), want_time) < TOL
    assert rel_err(ours.action_in_proj(noise), want_actions) < TOL

    x = torch.randn(2 * CHUNK, 24)
    ref_norm = ref.model.dit.layers[0].input_layernorm
    want_x, want_gate = ref_norm(x.view(2, CHUNK, 24), want_time)
    got_x, got_gate = ours.paligemma_with_expert.gemma_expert.model.layers[0].input_layernorm(x, want_time)
    assert rel_err(got_x, want_x.reshape(2 * CHUNK, 24)) < TOL
    assert rel_err(got_gate.view(2, CHUNK, 24)[:, 0], want_gate[:, 0]) < TOL

    h = torch.randn(7, 32)
    lm, ref_lm = ours.language_model, ref.model.vlm.language_model
    assert rel_err(lm.layers[0].mlp(h), ref_lm.layers[0].mlp(h)) < TOL
    assert rel_err(lm.norm(h), ref_lm.norm(h)) < TOL
    ids = torch.randint(0, 90, (9,))
    assert rel_err(lm.embed(ids), ref_lm.embed_tokens(ids)) < TOL


def ours_prefix(ours: Pi05Policy, observations):
    lengths = [len(p) * 16 + len(ids) for p, ids in observations]
    page_size = 4
    pages, nxt = [], 1  # page 0 left unused: a wrong slot would show
    for n in lengths:
        count = -(-n // page_size)
        pages.append(list(range(nxt, nxt + count)))
        nxt += count
    caches = allocate_kv_cache(2, nxt, page_size, 1, 16, torch.float32, "cpu")
    embeds = ours.embed_prefix([ours.encode_images(p) for p, _ in observations], [ids for _, ids in observations])
    hidden = ours.prefill(embeds, caches, step_metadata(pages, [0] * len(lengths), lengths, page_size))
    return hidden.split(lengths)


OBSERVATION_SETS = {
    "one camera": [(11, 1, 7)],
    "two cameras": [(12, 2, 13)],
    "batched 2+1 cameras": [(13, 2, 9), (14, 1, 15)],
    "batched 1+2+2 cameras": [(15, 1, 4), (16, 2, 11), (17, 2, 6)],
}


@pytest.mark.parametrize("name", list(OBSERVATION_SETS))
@torch.no_grad()
def test_prefix_hidden_and_logits(models, name):
    ref, ours = models
    observations = [observation(*o) for o in OBSERVATION_SETS[name]]
    input_ids, mask, pixels, pixel_mask = reference_inputs(observations)
    embeds = ref.model.embed_prefix(input_ids, pixels, pixel_mask)
    out = ref.model.vlm(inputs_embeds=embeds, attention_mask=mask, position_ids=mask.cumsum(-1) - 1,
                        token_type_ids=torch.zeros_like(mask)).last_hidden_state
    embedding = ref.model.vlm.language_model.embed_tokens.weight
    for b, hidden in enumerate(ours_prefix(ours, observations)):
        want = out[b, : len(hidden)]
        assert rel_err(hidden, want) < TOL
        assert rel_err(ours.language_model.logits(hidden), want @ embedding.t()) < TOL


@pytest.mark.parametrize("name", list(OBSERVATION_SETS))
@torch.no_grad()
def test_sample_actions(models, name):
    ref, ours = models
    observations = [observation(*o) for o in OBSERVATION_SETS[name]]
    input_ids, mask, pixels, pixel_mask = reference_inputs(observations)
    noise = noise_for(len(observations))
    want = ref.sample_actions(input_ids, pixels, noise=noise.clone(), attention_mask=mask,
                              pixel_attention_mask=pixel_mask, num_steps=STEPS)
    got = ours.sample_actions([p for p, _ in observations], [ids for _, ids in observations], noise, page_size=4)
    assert got.shape == (len(observations), CHUNK, ACTION_DIM)
    assert rel_err(got, want) < TOL
    for b, obs in enumerate(observations):  # each alone equals its row of the batch
        solo = ours.sample_actions([obs[0]], [obs[1]], noise[b:b + 1], page_size=4)
        assert rel_err(solo[0], want[b]) < TOL
