"""Parity of Qwen3-Omni's video path with transformers on a tiny random config (fp32, CPU): the
encoder's rows and deepstack features for a video grid (three temporal groups of two frames)
beside an image; the MRoPE positions of text + image + audio + video prompts against
``get_rope_index`` (whole and fractional temporal steps); then the thinker's logits for a
text + image + video prompt (image and video rows spliced in prompt order, their deepstack
features joined, the video's temporal positions at ``seconds_per_grid *
position_id_per_seconds``) at prefill and two greedy decode steps on paged KV."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_omni_moe")

from mstar.model.qwen3_omni.audio import audio_token_count  # noqa: E402
from mstar.model.qwen3_omni.checkpoint import Qwen3OmniThinker, load_thinker  # noqa: E402
from mstar.model.qwen3_omni.inputs import (  # noqa: E402
    audio_run,
    image_run,
    interleave_audio,
    media_positions,
    splice_vision,
)
from mstar.model.qwen3_omni.vision import Qwen3OmniVisionConfig  # noqa: E402
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

IMAGE = (1, 4, 6)  # 6 tokens
VIDEO = (3, 4, 4)  # 3 temporal groups of 4 tokens
PATCH_DIM = 3 * 2 * 4 * 4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def reference():
    return reference_thinker(seed=12, vision=VISION_DEEP)


@pytest.fixture(scope="module")
def config(reference) -> Qwen3OmniVisionConfig:
    d = reference.config.to_dict()
    d["vision_end_token_id"] = VISION_END
    return Qwen3OmniVisionConfig.from_hf_dict(d)


def patches(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


def prompt(config: Qwen3OmniVisionConfig, audio_frames: int | None) -> list[int]:
    audio = [] if audio_frames is None else [7, *audio_run(audio_token_count(audio_frames), AUDIO_START, AUDIO_TOKEN,
                                                            AUDIO_END)]
    return [5, 17, *image_run(IMAGE, config), 40, *audio, 41, *image_run(VIDEO, config, video=True), 9, 11]


@pytest.mark.parametrize("seconds", [1.0, 0.5, 2 / 3])
def test_positions_match_get_rope_index(reference, config, seconds: float) -> None:
    frames = 130  # 17 audio tokens
    ids = prompt(config, frames)
    got, delta = media_positions(ids, [IMAGE, VIDEO], [seconds], config)
    want, want_delta = reference.model.get_rope_index(
        torch.tensor([ids]), image_grid_thw=torch.tensor([IMAGE]), video_grid_thw=torch.tensor([VIDEO]),
        attention_mask=torch.ones(1, len(ids)), audio_seqlens=torch.tensor([frames]),
        second_per_grids=torch.tensor([seconds]))
    assert config.position_id_per_seconds == 25  # transformers' default: 25 or 12.5 or 16.67 a group
    assert torch.equal(got.float(), want[:, 0])
    assert got.dtype == (torch.int64 if seconds == 1.0 else torch.float32)
    assert delta == pytest.approx(float(want_delta), abs=1e-4) and delta > 0  # the video's steps pass its tokens


@torch.no_grad()
def test_video_prompt_logits(reference, config) -> None:
    thinker = Qwen3OmniThinker.from_hf_dict({"thinker_config": reference.config.to_dict()}).eval()
    load_thinker(thinker, released_keys(reference))
    text = thinker.text
    seconds = 0.5  # 12.5 positions a temporal group: fractional positions
    ids_list = prompt(config, None)
    image, video = patches(IMAGE, seed=13), patches(VIDEO, seed=14)

    # the encoder on both grids in prompt order equals transformers' image and video calls
    features = thinker.visual(torch.cat([image, video]), [IMAGE, VIDEO])
    want_video = reference.model.get_video_features(video, torch.tensor([VIDEO]))
    torch.testing.assert_close(features.embeds[6:], want_video.pooler_output[0], rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(features.deepstack, want_video.deepstack_features, strict=True):
        torch.testing.assert_close(ours[6:], theirs[0], rtol=1e-5, atol=1e-5)

    def hf_logits(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens])
        return reference(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=image,
                         image_grid_thw=torch.tensor([IMAGE]), pixel_values_videos=video,
                         video_grid_thw=torch.tensor([VIDEO]), video_second_per_grid=torch.tensor([seconds]),
                         use_cache=False).logits[0]

    ids = torch.tensor(ids_list)
    embeds, deepstack = splice_vision(text.embed_input_ids(ids), ids, config, features)
    positions, delta = media_positions(ids_list, [IMAGE, VIDEO], [seconds], config)
    assert positions.dtype == torch.float32 and (positions[0] % 1 == 0.5).any()
    worst = greedy_media_worst(text, ids_list, embeds, deepstack, positions, delta, hf_logits, seed=15)
    print(f"[parity] qwen3-omni thinker video+image+text: worst logits rel err {worst:.2e}")
    assert worst < 1e-4


def test_refusals(config) -> None:
    ids = image_run(VIDEO, config, video=True)
    with pytest.raises(ValueError, match="no seconds per grid"):
        media_positions(ids, [VIDEO], [], config)
    with pytest.raises(ValueError, match="12 vision tokens at 1 for a 2x2x2"):
        media_positions(ids, [(2, 4, 4)], [1.0], config)
    with pytest.raises(ValueError, match="more grids"):
        media_positions(ids, [VIDEO, IMAGE], [1.0], config)


# ---------------------------------------------------------------- a video with its soundtrack
def audio_in_video(config: Qwen3OmniVisionConfig, frames: int, seconds: float,
                   grid: tuple[int, int, int] = VIDEO) -> list[int]:
    pads = interleave_audio(grid, seconds, audio_token_count(frames), config, AUDIO_TOKEN)
    return [config.vision_start_token_id, AUDIO_START, *pads, AUDIO_END, VISION_END]


@pytest.mark.parametrize("seconds, frames, grid", [(0.5, 130, VIDEO), (2 / 3, 130, VIDEO), (1.0, 250, VIDEO),
                                                  (1.0, 30, VIDEO), (1.0, 30, (1, 12, 4))])
def test_audio_in_video_positions_match_get_rope_index(reference, config, seconds: float, frames: int,
                                                       grid: tuple[int, int, int]) -> None:
    """An image and a plain clip before a video with its soundtrack (17 tokens of 130 frames,
    32 of 250: more audio than video time; 4 of 30: less). The last case, one tall group then
    4 audio tokens, puts the run's last piece (the audio) below its largest position (row 5):
    the tokens after it resume from the piece, as the reference does."""
    ids = [5, *image_run(IMAGE, config), 7, *audio_run(audio_token_count(130), AUDIO_START, AUDIO_TOKEN, AUDIO_END),
           8, *audio_in_video(config, frames, seconds, grid), 9, 11]
    got, delta = media_positions(ids, [IMAGE, grid], [seconds], config, audio_token=AUDIO_TOKEN)
    want, want_delta = reference.model.get_rope_index(
        torch.tensor([ids]), image_grid_thw=torch.tensor([IMAGE]), video_grid_thw=torch.tensor([grid]),
        attention_mask=torch.ones(1, len(ids)), use_audio_in_video=True, audio_seqlens=torch.tensor([130, frames]),
        second_per_grids=torch.tensor([seconds]))
    assert torch.equal(got.float(), want[:, 0])
    assert delta == pytest.approx(float(want_delta), abs=1e-4)


@torch.no_grad()
def test_audio_in_video_logits(reference, config) -> None:
    from mstar.model.qwen3_omni.inputs import splice_features

    thinker = Qwen3OmniThinker.from_hf_dict({"thinker_config": reference.config.to_dict()}).eval()
    load_thinker(thinker, released_keys(reference))
    text = thinker.text
    seconds, frames = 0.5, 130
    ids_list = [5, 17, *audio_in_video(config, frames, seconds), 9, 11]
    video = patches(VIDEO, seed=16)
    mel = torch.randn(16, frames, generator=torch.Generator().manual_seed(17))

    def hf_logits(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens])
        return reference(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=mel[None],
                         feature_attention_mask=torch.ones(1, frames, dtype=torch.long), pixel_values_videos=video,
                         video_grid_thw=torch.tensor([VIDEO]), video_second_per_grid=torch.tensor([seconds]),
                         use_audio_in_video=True, use_cache=False).logits[0]

    ids = torch.tensor(ids_list)
    embeds = splice_features(text.embed_input_ids(ids), ids, AUDIO_TOKEN, thinker.audio_tower([mel]))
    embeds, deepstack = splice_vision(embeds, ids, config, thinker.visual(video, [VIDEO]))
    positions, delta = media_positions(ids_list, [VIDEO], [seconds], config, audio_token=AUDIO_TOKEN)
    worst = greedy_media_worst(text, ids_list, embeds, deepstack, positions, delta, hf_logits, seed=18)
    print(f"[parity] qwen3-omni thinker audio-in-video: worst logits rel err {worst:.2e}")
    assert worst < 1e-4
