"""The whole Qwen3.5 model with images and video against transformers'
Qwen3_5ForConditionalGeneration (tiny random config, fp32, CPU): a text-only request, one
with two images and one with a video batched through the vision node (one forward for all
their media) and the hybrid engine's paged KV and state slots; logits at prefill and at
every decode step. The checkpoint is written by the transformers class (real key layout,
``model.visual.*`` included) and loads with coverage checked both ways."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5Config as HFConfig
from transformers import Qwen3_5ForConditionalGeneration as HFConditional

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem, StatelessEngine
from mstar.model.qwen3_5 import Qwen3_5ForCausalLM
from mstar.model.qwen3_5.checkpoint import Qwen3_5Checkpoint, load_checkpoint
from mstar.model.qwen3_5.engine import hybrid_engine, vision_fn
from mstar.model.qwen3_5.processor import (
    ImageProcessing,
    Video,
    VideoProcessing,
    process_image,
    process_video,
)
from mstar.model.qwen3_5.prompt import (
    VisionTokens,
    expand_placeholders,
    mrope_positions,
)
from mstar.model.qwen3_5.vision import Qwen3_5VisionModel
from mstar.model.weights import WeightLoadError

TOL = 1e-4
VOCAB = 160
TOKENS = VisionTokens(image=150, video=151, start=152, end=153, merge=2)
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            rms_norm_eps=1e-6, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
IMAGES = ImageProcessing(patch_size=4, merge_size=2, min_pixels=8 * 8, max_pixels=24 * 24)
VIDEOS = VideoProcessing(patch_size=4, merge_size=2, min_pixels=8 * 8, max_pixels=16 * 16 * 8, fps=2.0,
                         min_frames=4, max_frames=6)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[HFConditional, Path]:
    config = HFConfig(text_config=dict(TEXT), vision_config=VISION, image_token_id=TOKENS.image,
                      video_token_id=TOKENS.video, vision_start_token_id=TOKENS.start,
                      vision_end_token_id=TOKENS.end, tie_word_embeddings=False)
    model = HFConditional(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.3 if param.ndim == 1 else 0.1))
            if name.endswith("linear_attn.norm.weight"):
                param.add_(1.0)
    directory = tmp_path_factory.mktemp("qwen3_5_vl")
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(model.config.to_dict()))
    return model, directory


@pytest.fixture(scope="module")
def ours(checkpoint) -> tuple[Qwen3_5ForCausalLM, Qwen3_5VisionModel]:
    _, directory = checkpoint
    ckpt = Qwen3_5Checkpoint.locate(str(directory))
    model, tower = Qwen3_5ForCausalLM(ckpt.config()).eval(), Qwen3_5VisionModel(ckpt.vision_config()).eval()
    load_checkpoint(model, ckpt.tensors(), visual=tower)
    return model, tower


def _encode(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


def _requests() -> dict[str, tuple[list[int], list]]:
    """Expanded prompt ids and media of: text only, text+two images+text, text+video+text."""
    rng = np.random.default_rng(4)
    images = [process_image(_picture(rng, 30, 20), IMAGES), process_image(_picture(rng, 16, 40), IMAGES)]
    video = process_video(Video(rng.integers(0, 255, (9, 20, 28, 3), dtype=np.uint8), 4.0), VIDEOS)
    text = lambda n: rng.integers(0, 140, n).tolist()  # noqa: E731
    s, e = TOKENS.start, TOKENS.end
    prompts = {
        "text": (text(9), []),
        "image": (text(5) + [s, TOKENS.image, e] + text(3) + [s, TOKENS.image, e] + text(4), images),
        "video": (text(4) + [s, TOKENS.video, e] + text(6), [video]),
    }
    return {rid: (expand_placeholders(ids, media, TOKENS, _encode), media) for rid, (ids, media) in prompts.items()}


def _picture(rng, height: int, width: int):
    from PIL import Image

    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def _engine(model: Qwen3_5ForCausalLM) -> AutoregressiveEngine:
    config = model.config
    return hybrid_engine(model, KVLayout(len(config.full_layers), config.num_key_value_heads, config.head_dim),
                         num_state_layers=len(config.linear_layers), state_shapes=model.state_shapes(),
                         max_slots=4, state_dtype=torch.float32, media_token_ids=(TOKENS.image, TOKENS.video),
                         num_pages=40, page_size=8, max_seq_len=256, device=torch.device("cpu"), dtype=torch.float32)


def _reference_logits(reference: HFConditional, ids: list[int], media: list) -> torch.Tensor:
    kwargs = {}
    images = [m for m in media if m.kind == "image"]
    videos = [m for m in media if m.kind == "video"]
    if images:
        kwargs.update(pixel_values=torch.cat([m.patches for m in images]),
                      image_grid_thw=torch.tensor([m.grid for m in images]))
    if videos:
        kwargs.update(pixel_values_videos=torch.cat([m.patches for m in videos]),
                      video_grid_thw=torch.tensor([m.grid for m in videos]))
    types = torch.tensor([[1 if t == TOKENS.image else 2 if t == TOKENS.video else 0 for t in ids]])
    return reference(input_ids=torch.tensor([ids]), mm_token_type_ids=types, **kwargs).logits[0]


@torch.no_grad()
def test_batched_text_image_video_match_transformers(checkpoint, ours) -> None:
    reference, _ = checkpoint
    model, tower = ours
    engine, vision = _engine(model), StatelessEngine(vision_fn(tower))
    recorded: list[torch.Tensor] = []
    original = model.compute_logits
    model.compute_logits = lambda hidden: recorded.append(original(hidden)) or recorded[-1]
    requests = _requests()
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": 50}
    try:
        media_ids = [rid for rid, (_, media) in requests.items() if media]
        embeds = vision.run([EngineItem(rid, "forward", 0, {
            "pixel_values": torch.cat([m.patches for m in requests[rid][1]]),
            "grid_thw": torch.tensor([m.grid for m in requests[rid][1]])}, {}) for rid in media_ids])
        prefills = []
        for rid, (ids, media) in requests.items():
            inputs = {"prompt_ids": torch.tensor(ids)}
            if media:
                inputs["vision_embeds"] = embeds[media_ids.index(rid)].outputs["vision_embeds"]
                inputs["mrope_positions"] = mrope_positions(ids, [m.grid for m in media], TOKENS)[0]
            prefills.append(EngineItem(rid, "prefill", 0, inputs, params))
        tokens = {rid: [] for rid in requests}
        logits = {rid: [] for rid in requests}
        outputs = engine.run(prefills)
        for (rid, out), row in zip(zip(requests, outputs), recorded[-1]):
            tokens[rid].append(int(out.outputs["token"]))
            logits[rid].append(row)
        for _ in range(4):
            order = list(requests)[::-1]
            outputs = engine.run([EngineItem(rid, "decode", 0, {"token": torch.tensor([tokens[rid][-1]])}, params)
                                  for rid in order])
            for rid, out, row in zip(order, outputs, recorded[-1]):
                tokens[rid].append(int(out.outputs["token"]))
                logits[rid].append(row)
    finally:
        del model.compute_logits
    deltas = engine.forward.rope_deltas
    assert deltas["image"] < 0 and deltas["video"] < 0 and "text" not in deltas
    for rid, (ids, media) in requests.items():
        ref = _reference_logits(reference, ids + tokens[rid][:-1], media)[len(ids) - 1:]
        assert len(logits[rid]) == ref.shape[0]
        for i, row in enumerate(logits[rid]):
            assert rel_err(row, ref[i]) <= TOL, f"request {rid} step {i}: relative error {rel_err(row, ref[i]):.2e}"
    for rid in requests:
        engine.release(rid)
    assert engine.forward.rope_deltas == {} and engine.forward.states.num_used == 0 and engine.pool.num_used_pages == 0


@torch.no_grad()
def test_vision_embeddings_must_fill_the_media_tokens(ours) -> None:
    model, _ = ours
    engine = _engine(model)
    ids = [1, TOKENS.start, TOKENS.image, TOKENS.image, TOKENS.end, 2]
    item = EngineItem("x", "prefill", 0, {"prompt_ids": torch.tensor(ids), "vision_embeds": torch.zeros(3, 64),
                                          "mrope_positions": torch.arange(6).expand(3, -1)}, {})
    with pytest.raises(ValueError, match="2 media tokens but 3 vision embeddings"):
        engine.run([item])
    assert not engine.forward.states.has("x") and "x" not in engine.forward.rope_deltas


def test_checkpoint_coverage_both_ways(checkpoint) -> None:
    _, directory = checkpoint
    ckpt = Qwen3_5Checkpoint.locate(str(directory))
    tensors = dict(ckpt.tensors())
    config, vision_config = ckpt.config(), ckpt.vision_config()
    missing = {k: v for k, v in tensors.items() if k != "model.visual.blocks.1.attn.qkv.weight"}
    with pytest.raises(WeightLoadError, match=r"did not fill .*visual\.blocks\.1\.attn\.qkv\.weight"):
        load_checkpoint(Qwen3_5ForCausalLM(config), missing.items(), visual=Qwen3_5VisionModel(vision_config))
    extra = dict(tensors, **{"model.visual.blocks.7.mlp.linear_fc1.weight": torch.zeros(1)})
    with pytest.raises(WeightLoadError, match=r"nothing loads .*model\.visual\.blocks\.7\.mlp"):
        load_checkpoint(Qwen3_5ForCausalLM(config), extra.items(), visual=Qwen3_5VisionModel(vision_config))
    # A rank holding only the vision node loads the tower alone, coverage still checked.
    tower = Qwen3_5VisionModel(vision_config)
    load_checkpoint(None, tensors.items(), visual=tower)
    assert torch.equal(tower.merger.linear_fc2.weight, tensors["model.visual.merger.linear_fc2.weight"])
    with pytest.raises(WeightLoadError, match=r"did not fill .*blocks\.1\.attn\.qkv\.weight"):
        load_checkpoint(None, missing.items(), visual=Qwen3_5VisionModel(vision_config))
