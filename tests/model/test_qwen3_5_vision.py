"""The Qwen3.5 vision side against transformers on tiny random configs (fp32, CPU): the ViT
tower over several images and a video batched in one forward; the image processor and the
video processor's steps, exactly; placeholder expansion and MRoPE positions (get_rope_index)
for interleaved text, image and video prompts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3_5Config as HFConfig
from transformers import Qwen3_5VisionConfig as HFVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model as HFModel
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel as HFVision
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as hf_smart_resize_video,
)
from transformers.video_utils import VideoMetadata

from mstar.model.qwen3_5.config import Qwen3_5VisionConfig
from mstar.model.qwen3_5.processor import (
    ImageProcessing,
    Media,
    MediaError,
    Video,
    VideoProcessing,
    _patchify,
    decode_animation,
    frame_timestamps,
    process_image,
    process_video,
    sample_indices,
    sampled_video,
    smart_resize_video,
)
from mstar.model.qwen3_5.prompt import (
    VisionTokens,
    expand_placeholders,
    mrope_positions,
)
from mstar.model.qwen3_5.vision import Qwen3_5VisionModel

VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=24, num_position_embeddings=36)
IMAGE_CFG = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.4, 0.3],
             "image_std": [0.2, 0.3, 0.25], "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 64 * 64 * 12}}
VIDEO_CFG = {"size": {"shortest_edge": 4096, "longest_edge": 64 * 64 * 40}, "patch_size": 16, "fps": 2,
             "min_frames": 4, "max_frames": 20}
TOKENS = VisionTokens(image=150, video=151, start=152, end=153, merge=2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ------------------------------------------------------------------ the tower
@pytest.fixture(scope="module")
def towers() -> tuple[HFVision, Qwen3_5VisionModel]:
    reference = HFVision._from_config(HFVisionConfig(**VISION)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    ours = Qwen3_5VisionModel(Qwen3_5VisionConfig.from_hf_dict({"vision_config": reference.config.to_dict()}))
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours.eval()


@torch.no_grad()
def test_tower_matches_transformers_on_a_batch_of_media(towers) -> None:
    """Two images of the same grid (one attention bucket), a two-group video, a grid larger
    than the learned 6x6 table (interpolation up) and the smallest grid."""
    reference, ours = towers
    grids = torch.tensor([[1, 4, 6], [2, 8, 4], [1, 4, 6], [1, 10, 8], [1, 2, 2]])
    patches = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    ref = reference(patches, grid_thw=grids).pooler_output
    out = ours(patches, grids)
    assert out.shape == ref.shape == (int(grids.prod(-1).sum()) // 4, 24)
    assert rel_err(out, ref) <= 1e-5
    # Each media attends only to itself: alone, it gives its rows of the batch.
    sizes = (grids.prod(-1)).tolist()
    offsets = np.cumsum([0] + sizes)
    for i, grid in enumerate(grids.tolist()):
        single = ours(patches[offsets[i]:offsets[i + 1]], [grid])
        assert rel_err(single, out[offsets[i] // 4:offsets[i + 1] // 4]) <= 1e-5


def test_tower_refuses_patches_that_do_not_fill_the_grids(towers) -> None:
    _, ours = towers
    with pytest.raises(ValueError, match="patches for grids"):
        ours(torch.zeros(10, 96), [[1, 4, 4]])


# -------------------------------------------------------------------- images
@pytest.mark.parametrize("size,mode", [((50, 70), "RGB"), ((200, 97), "RGBA"), ((17, 300), "L"), ((64, 64), "P"),
                                       ((900, 700), "RGB")])
def test_image_processor_is_exact(size: tuple[int, int], mode: str) -> None:
    """Downscaled, upscaled, transparent, grey and palette images: the same patches, bit for bit."""
    height, width = size
    rng = np.random.default_rng(height * width)
    pixels = rng.integers(0, 255, (height, width, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA" if mode == "RGBA" else "RGB")
    if mode in ("L", "P"):
        image = image.convert(mode)
    ref = Qwen2VLImageProcessorPil(**IMAGE_CFG)(images=[image], return_tensors="pt")
    ours = process_image(image, ImageProcessing.from_hf_dict(IMAGE_CFG))
    assert [list(ours.grid)] == ref["image_grid_thw"].tolist()
    assert torch.equal(ours.patches, ref["pixel_values"])


def test_image_config_reads_min_max_pixels() -> None:
    cfg = ImageProcessing.from_hf_dict({"min_pixels": 100, "max_pixels": 5000, "size": {"shortest_edge": 1,
                                                                                         "longest_edge": 2}})
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size) == (100, 5000, 14)


# -------------------------------------------------------------------- videos
@pytest.mark.parametrize("total,fps", [(10, 24.0), (100, 30.0), (7, None), (3000, 25.0), (3, 2.0)])
def test_frame_sampling_and_timestamps_match(total: int, fps: float | None) -> None:
    cfg = VideoProcessing.from_hf_dict(VIDEO_CFG)
    reference = Qwen3VLVideoProcessor(**VIDEO_CFG)
    ref = reference.sample_frames(VideoMetadata(total_num_frames=total, fps=fps))
    ours = sample_indices(total, fps, cfg)
    assert np.array_equal(ours, ref)
    ref_times = Qwen3VLProcessor._calculate_timestamps(None, ref, 24 if fps is None else fps, 2)
    assert frame_timestamps(ours, fps, 2) == ref_times


@pytest.mark.parametrize("frames,height,width", [(8, 48, 80), (5, 10, 700), (40, 1080, 1920), (4, 16, 16)])
def test_video_resize_rule_matches(frames: int, height: int, width: int) -> None:
    args = dict(temporal_factor=2, factor=32, min_pixels=4096, max_pixels=64 * 64 * 40)
    assert smart_resize_video(frames, height, width, **args) == hf_smart_resize_video(frames, height, width, **args)


def test_video_patch_layout_matches() -> None:
    cfg = VideoProcessing.from_hf_dict(VIDEO_CFG)
    frames = torch.randn(4, 3, 64, 96, generator=torch.Generator().manual_seed(2))
    ref, t, h, w = Qwen3VLVideoProcessor(**VIDEO_CFG).patchify(frames[None], 16, 2, 2)
    ours, gh, gw = _patchify(frames, cfg)
    assert (t, h, w) == (2, gh, gw) and torch.equal(ours, ref[0])


@pytest.mark.parametrize("cap", [False, True])
def test_video_processor_is_exact(cap: bool) -> None:
    """The whole video path against transformers' processor (it needs torchvision)."""
    pytest.importorskip("torchvision")
    reference = Qwen3VLVideoProcessor(**VIDEO_CFG, cap_pixels_per_frame=cap)
    cfg = VideoProcessing.from_hf_dict(dict(VIDEO_CFG, cap_pixels_per_frame=cap))
    rng = np.random.default_rng(3)
    for total, height, width, fps in [(30, 48, 80, 10.0), (9, 100, 60, 4.0), (5, 64, 64, 2.0)]:
        video = rng.integers(0, 255, (total, height, width, 3), dtype=np.uint8)
        ref = reference(videos=[video], video_metadata=[VideoMetadata(total_num_frames=total, fps=fps)],
                        return_tensors="pt")
        ours = process_video(Video(video, fps), cfg)
        assert [list(ours.grid)] == ref["video_grid_thw"].tolist()
        assert torch.equal(ours.patches, ref["pixel_values_videos"])


def test_animated_image_decodes_to_sampled_frames() -> None:
    """A GIF at 10 fps: the frames kept are those the sampling picks, at the file's rate."""
    import io

    cfg = VideoProcessing.from_hf_dict(VIDEO_CFG)
    colours = [(i * 20, 255 - i * 20, 128) for i in range(12)]
    frames = [Image.new("RGB", (40, 24), c) for c in colours]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    video, indices = decode_animation(buffer.getvalue(), cfg)
    assert video.fps == pytest.approx(10.0)
    assert np.array_equal(indices, sample_indices(12, 10.0, cfg))
    media = sampled_video(video, indices, cfg)
    direct = process_video(Video(np.stack([np.asarray(f) for f in _gif_frames(buffer.getvalue())]), 10.0), cfg)
    assert media.grid == direct.grid and torch.equal(media.patches, direct.patches)
    assert media.timestamps == direct.timestamps
    with pytest.raises(MediaError, match="max_video_pixels"):
        decode_animation(buffer.getvalue(), cfg, max_pixels=40 * 24 * 3)
    with pytest.raises(MediaError, match="cannot decode"):
        decode_animation(b"GIF89a-broken", cfg)


def _gif_frames(data: bytes) -> list[Image.Image]:
    import io

    from PIL import ImageSequence

    return [frame.convert("RGB") for frame in ImageSequence.Iterator(Image.open(io.BytesIO(data)))]


# ----------------------------------------------------- prompt and positions
def _media(kind: str, grid: tuple[int, int, int], timestamps=()) -> Media:
    return Media(kind, torch.zeros(0), grid, list(timestamps))


def _encode(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


def test_video_placeholder_expansion_matches_the_processor() -> None:
    """Transformers' Qwen3-VL processor's replacement text, tokenised, equals ours."""

    class Tok:
        image_token, video_token, image_token_id, video_token_id = "I", "V", TOKENS.image, TOKENS.video
        vision_start_token, vision_end_token = "S", "E"
        vision_start_token_id, vision_end_token_id = TOKENS.start, TOKENS.end

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.video_token, processor.vision_start_token, processor.vision_end_token = "V", "S", "E"
    processor.video_processor = Qwen3VLVideoProcessor(**VIDEO_CFG)
    indices = sample_indices(50, 10.0, VideoProcessing.from_hf_dict(VIDEO_CFG))
    grid = (len(indices) // 2, 4, 6)
    inputs = {"video_grid_thw": torch.tensor([grid]),
              "video_metadata": [VideoMetadata(total_num_frames=50, fps=10.0, frames_indices=indices)]}
    text = processor.replace_video_token(inputs, 0)
    mapping = {"V": TOKENS.video, "S": TOKENS.start, "E": TOKENS.end}
    ref = [mapping.get(c, None) if c in mapping else _encode(c)[0] for c in text]
    media = _media("video", grid, frame_timestamps(indices, 10.0, 2))
    assert expand_placeholders([TOKENS.video], [media], TOKENS, _encode) == ref


def test_placeholders_must_follow_the_media() -> None:
    with pytest.raises(ValueError, match="do not follow"):
        expand_placeholders([1, TOKENS.video], [_media("image", (1, 2, 2))], TOKENS, _encode)
    with pytest.raises(ValueError, match="fewer media placeholders"):
        expand_placeholders([1], [_media("image", (1, 2, 2))], TOKENS, _encode)


def test_mrope_positions_match_get_rope_index() -> None:
    """Text, an image, text, a three-group video, an image, text: our positions and rope
    delta against transformers' get_rope_index on the same ids."""
    config = HFConfig(text_config=dict(vocab_size=160, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                       linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=8,
                                       linear_value_head_dim=8),
                      vision_config=VISION, image_token_id=TOKENS.image, video_token_id=TOKENS.video,
                      vision_start_token_id=TOKENS.start, vision_end_token_id=TOKENS.end)
    reference = HFModel(config)
    media = [_media("image", (1, 4, 6)), _media("video", (3, 6, 4), [0.25, 1.25, 2.5]), _media("image", (1, 8, 2))]
    template = ([5, 6, 7, TOKENS.start, TOKENS.image, TOKENS.end, 8, 9, TOKENS.start, TOKENS.video, TOKENS.end]
                + [TOKENS.start, TOKENS.image, TOKENS.end, 10, 11, 12])
    ids = expand_placeholders(template, media, TOKENS, _encode)
    positions, delta = mrope_positions(ids, [m.grid for m in media], TOKENS)
    types = torch.tensor([[1 if t == TOKENS.image else 2 if t == TOKENS.video else 0 for t in ids]])
    ref_pos, ref_delta = reference.get_rope_index(
        torch.tensor([ids]), types, image_grid_thw=torch.tensor([[1, 4, 6], [1, 8, 2]]),
        video_grid_thw=torch.tensor([[3, 6, 4]]))
    assert torch.equal(positions, ref_pos[:, 0]) and delta == int(ref_delta)
    text_only, text_delta = mrope_positions([1, 2, 3], [], TOKENS)
    assert torch.equal(text_only, torch.arange(3).expand(3, -1)) and text_delta == 0
    with pytest.raises(ValueError, match="merged grid"):
        mrope_positions([TOKENS.image] * 5, [(1, 4, 4)], TOKENS)
