"""Parity of Qwen3-Omni's vision path with transformers on a tiny random config (fp32, CPU): the
encoder's merged tokens and deepstack features for several images (and a two-frame grid) in one
call; the MRoPE positions of a text + audio + image prompt against ``get_rope_index``; then the
thinker's logits for an image + text prompt (rows spliced over the image pads, deepstack added
after the first layers, 3-axis positions) at prefill and two greedy decode steps on paged KV."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_omni_moe")

from mstar.model.qwen3_omni.audio import audio_token_count  # noqa: E402
from mstar.model.qwen3_omni.checkpoint import Qwen3OmniThinker, load_thinker, load_visual  # noqa: E402
from mstar.model.qwen3_omni.inputs import (  # noqa: E402
    audio_run,
    image_positions,
    image_run,
    splice_images,
)
from mstar.model.qwen3_omni.modeling import Deepstack  # noqa: E402
from mstar.model.qwen3_omni.vision import Qwen3OmniVisionConfig, Qwen3OmniVisionEncoder  # noqa: E402
from tests.support.qwen3_omni import (  # noqa: E402
    AUDIO_END,
    AUDIO_START,
    AUDIO_TOKEN,
    VISION_DEEP,
    VISION_END,
    greedy_media_worst,
    reference_thinker,
    released_keys,
)

GRIDS = [(1, 4, 6), (1, 12, 10)]  # below and above the 8x8 position table; 6 and 30 tokens
PATCH_DIM = 3 * 2 * 4 * 4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def reference():
    return reference_thinker(seed=8, vision=VISION_DEEP)


@pytest.fixture(scope="module")
def config(reference) -> Qwen3OmniVisionConfig:
    d = reference.config.to_dict()
    d["vision_end_token_id"] = VISION_END  # not a thinker config key: the processor's
    return Qwen3OmniVisionConfig.from_hf_dict(d)


def patches(grids: list[tuple[int, int, int]], seed: int) -> torch.Tensor:
    count = sum(t * h * w for t, h, w in grids)
    return torch.randn(count, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_encoder_matches_transformers(reference, config) -> None:
    encoder = Qwen3OmniVisionEncoder(config).eval()
    load_visual(encoder, released_keys(reference))
    grids = [*GRIDS, (2, 4, 4)]
    pixels = patches(grids, seed=9)
    want = reference.model.visual(pixels, grid_thw=torch.tensor(grids))
    got = encoder(pixels, grids)
    assert got.embeds.shape == (6 + 30 + 8, 64) and len(got.deepstack) == 2
    torch.testing.assert_close(got.embeds, want.pooler_output, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(got.deepstack, want.deepstack_features, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_positions_match_get_rope_index(reference, config) -> None:
    frames = 130  # 17 audio tokens
    ids = [5, 6, *image_run(GRIDS[0], config), 7, *audio_run(audio_token_count(frames), AUDIO_START, AUDIO_TOKEN,
                                                               AUDIO_END),
           8, 9, *image_run(GRIDS[1], config), *image_run(GRIDS[0], config), 10]
    got, delta = image_positions(ids, [GRIDS[0], GRIDS[1], GRIDS[0]], config)
    want, want_delta = reference.model.get_rope_index(torch.tensor([ids]), image_grid_thw=torch.tensor(
        [GRIDS[0], GRIDS[1], GRIDS[0]]), attention_mask=torch.ones(1, len(ids)), audio_seqlens=torch.tensor([frames]))
    assert torch.equal(got, want[:, 0].long())
    assert delta == int(want_delta) < 0  # images take fewer positions than tokens


@torch.no_grad()
def test_image_prompt_logits(reference, config) -> None:
    thinker = Qwen3OmniThinker.from_hf_dict({"thinker_config": reference.config.to_dict()}).eval()
    load_thinker(thinker, released_keys(reference))
    text = thinker.text
    prompt = [5, 17, *image_run(GRIDS[0], config), 40, 41, *image_run(GRIDS[1], config), 7, 9, 11]
    pixels = patches(GRIDS, seed=10)

    def hf_logits(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens])
        return reference(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                         image_grid_thw=torch.tensor(GRIDS), use_cache=False).logits[0]

    ids = torch.tensor(prompt)
    embeds, deepstack = splice_images(text.embed_input_ids(ids), ids, config.image_token_id,
                                      thinker.visual(pixels, GRIDS))
    positions, delta = image_positions(prompt, GRIDS, config)
    worst = greedy_media_worst(text, prompt, embeds, deepstack, positions, delta, hf_logits, seed=11)
    print(f"[parity] qwen3-omni thinker image+text: worst logits rel err {worst:.2e}")
    assert worst < 1e-4


def test_refusals(config) -> None:
    with pytest.raises(ValueError, match=r"deepstack features \[\(3, 8\)\] for 2 image rows"):
        Deepstack(torch.tensor([True, False, True]), [torch.zeros(3, 8)])
    with pytest.raises(ValueError, match="media_positions"):
        image_positions([1, config.video_token_id], [], config)
    with pytest.raises(ValueError, match="t = 1"):
        image_positions(image_run((2, 4, 4), config), [(2, 4, 4)], config)
    with pytest.raises(ValueError, match="not blocks of a depth-3"):
        Qwen3OmniVisionConfig(**{**VISION_DEEP, "deepstack_visual_indexes": [3]})
