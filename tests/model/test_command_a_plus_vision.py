"""Command A+ image chat against transformers (fp32, CPU, tiny random configs): the tiling
bit-exact against ``Cohere2VisionImageProcessor``, the released vision-language key layout
loaded with coverage both ways, and the logits of an image prompt (prefill and decode steps,
batched with a text prompt) against ``Cohere2VisionForConditionalGeneration``."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.model.command_a_plus.checkpoint import CommandAPlusCheckpoint
from mstar.model.command_a_plus.processor import best_grid, image_to_tensor, image_token_ids, tile_image
from mstar.model.weights import ModelPathError, WeightLoadError

TILE = 32  # the tiny tower's image size
IDS = {"image": 100, "boi": 101, "eoi": 102, "line_break": 103}


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture
def hf_grid(monkeypatch):
    """transformers' ``get_optimal_tiled_canvas`` (plain numpy); its module imports
    torchvision's functional API at the top, stood in for when torchvision is absent."""
    import sys
    import types

    if importlib.util.find_spec("torchvision") is None:
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                     "torchvision.transforms.v2.functional"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        sys.modules["torchvision.transforms.v2"].functional = sys.modules["torchvision.transforms.v2.functional"]
        monkeypatch.delitem(sys.modules, "transformers.models.cohere2_vision.image_processing_cohere2_vision",
                            raising=False)
    module = importlib.import_module("transformers.models.cohere2_vision.image_processing_cohere2_vision")
    return module.get_optimal_tiled_canvas


def _recorded():
    """The recorder's cases and the tensors it wrote (``command_a_plus/record_reference.py``,
    run beside torch 2.9.1, torchvision 0.24.1, transformers 5.25.0; the versions are in the
    fixture's metadata)."""
    spec = importlib.util.spec_from_file_location("command_a_plus_record_reference", RECORDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with safe_open(module.FIXTURE, "pt") as f:
        meta = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    return module, tensors, json.loads(meta["grids"]), json.loads(meta["versions"])


RECORDER = Path(__file__).parent / "command_a_plus" / "record_reference.py"
RECORDED = _recorded()


@pytest.mark.parametrize("name", sorted(RECORDED[0].SMALL))
def test_tiles_are_bit_exact_small(name: str) -> None:
    """Every float32 tile equal to ``Cohere2VisionImageProcessor``'s (32x32 tiles, whole
    tensors recorded): one tile up- or downscaled, grids with the thumbnail, ``max_patches``
    of 6 and of 1."""
    module, tensors, grids, versions = RECORDED
    assert versions["transformers"] == "5.25.0" and versions["torchvision"].startswith("0.24.1")
    width, height, max_patches = module.SMALL[name]
    image = image_to_tensor(module.make_image(width, height, seed=width))
    assert list(best_grid(height, width, tile=32, max_tiles=max_patches)) == grids[f"small.{name}"]
    ours = tile_image(image, tile=32, max_tiles=max_patches)
    ref = tensors[f"small.{name}.pixel_values"]
    assert ours.shape[0] == int(tensors[f"small.{name}.num_patches"][0]) == ref.shape[0]
    assert ours.dtype == ref.dtype and torch.equal(ours, ref), (ours - ref).abs().max()


@pytest.mark.parametrize("name", sorted(RECORDED[0].FULL))
def test_tiles_are_bit_exact_released_size(name: str) -> None:
    """At the released 512x512 tiles (the processor's defaults): the SHA-256 of our float32
    tiles' bytes equals the recorded one's (per-tile sums say which tile differs if not)."""
    module, tensors, grids, _ = RECORDED
    width, height, max_patches = module.FULL[name]
    image = image_to_tensor(module.make_image(width, height, seed=width))
    assert list(best_grid(height, width)) == grids[f"full.{name}"]
    ours = tile_image(image, max_tiles=max_patches).contiguous()
    assert ours.shape[0] == int(tensors[f"full.{name}.num_patches"][0])
    sums = ours.double().sum(dim=(1, 2, 3))
    assert torch.equal(sums, tensors[f"full.{name}.tile_sums"]), sums - tensors[f"full.{name}.tile_sums"]
    assert hashlib.sha256(ours.numpy().tobytes()).digest() == bytes(tensors[f"full.{name}.sha256"].tolist())


def test_grid_choice_matches_transformers(hf_grid) -> None:
    for height in (100, 511, 512, 700, 1024, 1600, 3000):
        for width in (64, 512, 900, 1536, 2100, 6000):
            assert best_grid(height, width) == tuple(hf_grid((height, width), (512, 512), 1, 12))
    assert best_grid(30, 90, tile=32) == (3, 1)


def test_tiles_are_the_resized_canvas_cut_row_by_row() -> None:
    """Without torchvision at hand: the tiles are the canvas (torch's uint8 bicubic kernel,
    torchvision's CPU path) cut row by row, then the thumbnail, CLIP-normalised."""
    import torch.nn.functional as F

    image = image_to_tensor(_image(90, 30, seed=3))
    tiles = tile_image(image, tile=TILE)
    canvas = F.interpolate(image[None], size=[32, 96], mode="bicubic", antialias=True)[0]
    thumb = F.interpolate(image[None], size=[32, 32], mode="bicubic", antialias=True)[0]
    raw = torch.stack([canvas[:, :, :32], canvas[:, :, 32:64], canvas[:, :, 64:], thumb]).float()
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]) * 255.0
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]) * 255.0
    assert torch.equal(tiles, (raw - mean[:, None, None]) / std[:, None, None])
    assert tile_image(image_to_tensor(_image(30, 20, seed=3)), tile=TILE).shape == (1, 3, TILE, TILE)


def _vl_config() -> Cohere2VisionConfig:
    text = dict(model_type="cohere2_moe", vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
                num_shared_experts=1, sliding_window=8, max_position_embeddings=256, logit_scale=0.25,
                eos_token_id=2, bos_token_id=1)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, image_size=TILE, patch_size=8)
    return Cohere2VisionConfig(text_config=text, vision_config=vision, image_token_id=IDS["image"],
                               alignment_intermediate_size=64, attn_implementation="eager")


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> tuple[Cohere2VisionForConditionalGeneration, Path]:
    torch.manual_seed(0)
    hf = Cohere2VisionForConditionalGeneration(_vl_config()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("command_a_plus_vl")
    hf.save_pretrained(path)
    return hf, path


def test_checkpoint_coverage_both_ways(released, tmp_path: Path) -> None:
    _, path = released
    tensors = load_file(path / "model.safetensors")
    assert any(".mlp.experts.3.up_proj.weight" in k for k in tensors)  # the released per-expert layout
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    missing = {k: v for k, v in tensors.items() if "projector.linear_2.bias" not in k}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match="multi_modal_projector.linear_2.bias"):
        CommandAPlusCheckpoint.locate(tmp_path).load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    save_file(tensors | {"model.language_model.layers.0.mlp.extra.weight": torch.zeros(2)},
              tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match="mlp.extra.weight"):
        CommandAPlusCheckpoint.locate(tmp_path).load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    text_only = CommandAPlusCheckpoint.locate(path).load_model(torch.device("cpu"), torch.float32, dummy=False,
                                                               seed=0, vision=False)
    assert text_only.vision is None
    dummy = CommandAPlusCheckpoint.locate(path).load_model(torch.device("cpu"), torch.float32, dummy=True, seed=0)
    assert dummy.vision is not None
    legacy = {"model.language_model.": "language_model.model.", "model.vision_tower.": "vision_tower.vision_model.",
              "model.multi_modal_projector.": "multi_modal_projector."}  # the release's older layout

    def renamed(name: str) -> str:
        return next((new + name[len(old):] for old, new in legacy.items() if name.startswith(old)), name)

    save_file({renamed(k): v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    old = CommandAPlusCheckpoint.locate(tmp_path).load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    assert torch.equal(old.vision.multi_modal_projector.linear_2.bias,
                       tensors["model.multi_modal_projector.linear_2.bias"])
    assert torch.equal(old.model.layers[1].mlp.experts.down.weight[3],
                       tensors["model.language_model.layers.1.mlp.experts.3.down_proj.weight"])


def test_absent_weights_are_never_downloaded(tmp_path: Path) -> None:
    for model_path in (str(tmp_path / "nowhere"), "CohereLabs/not-in-the-cache-xyz", str(tmp_path)):
        with pytest.raises(ModelPathError, match="model_path"):
            CommandAPlusCheckpoint.locate(model_path, cache_dir=str(tmp_path / "hub"))


def _meta(spans: list[tuple[int, int]], tables: list[list[int]], page_size: int) -> PagedAttentionMetadata:
    """One step's metadata: row ``b`` runs positions ``[start, end)`` over ``tables[b]``."""
    positions = [p for start, end in spans for p in range(start, end)]
    slots = [tables[b][p // page_size] * page_size + p % page_size
             for b, (start, end) in enumerate(spans) for p in range(start, end)]
    starts = [0]
    for start, end in spans:
        starts.append(starts[-1] + end - start)
    width = max(len(t) for t in tables)
    return PagedAttentionMetadata(
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor([end for _, end in spans]),
        page_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]), page_size=page_size)


@torch.no_grad()
def test_image_chat_logits_match_transformers(released) -> None:
    hf, path = released
    ours = CommandAPlusCheckpoint.locate(path).load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    image = _image(90, 30, seed=7)  # a 3x1 grid of tiles and the thumbnail
    pixels = tile_image(image_to_tensor(image), tile=TILE)
    tiles = pixels.shape[0]
    assert tiles == 4
    vision = ours.vision_config
    image_prompt = [1, 5, 9, *image_token_ids(tiles, vision.tokens_per_tile, IDS), 17, 23, 31]
    text_prompt = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    page_size, num_pages = 4, 64
    layers, heads, dim = ours.cache_shape()
    caches = allocate_kv_cache(layers, num_pages, page_size, heads, dim, torch.float32, "cpu")
    tables = [list(range(0, 16)), list(range(16, 32))]
    seqs = [list(image_prompt), list(text_prompt)]

    def reference(tokens: list[int], with_image: bool) -> torch.Tensor:
        # transformers' vision-language class leaves out the text model's logit_scale (its
        # Cohere2MoeForCausalLM applies it, as the model was trained and as vLLM serves it): we
        # keep the scale, so its logits are compared scaled
        out = hf(torch.tensor([tokens]), pixel_values=pixels if with_image else None, use_cache=False).logits[0]
        return out * hf.config.text_config.logit_scale

    ids = torch.tensor(image_prompt + text_prompt)
    embeds = ours.embed_with_images(ids, pixels)
    meta = _meta([(0, len(image_prompt)), (0, len(text_prompt))], tables, page_size)
    logits = ours.compute_logits(ours(None, meta, caches, inputs_embeds=embeds))
    expected = torch.cat([reference(seqs[0], True), reference(seqs[1], False)])
    err = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert err <= 1e-5, f"prefill: {err:.2e}"
    gen = torch.Generator().manual_seed(4)
    for step in range(6):
        new = torch.randint(0, 99, (2,), generator=gen).tolist()
        for seq, token in zip(seqs, new):
            seq.append(token)
        meta = _meta([(len(s) - 1, len(s)) for s in seqs], tables, page_size)
        logits = ours.compute_logits(ours(torch.tensor(new), meta, caches))
        expected = torch.stack([reference(seqs[0], True)[-1], reference(seqs[1], False)[-1]])
        err = ((logits - expected).abs().max() / expected.abs().max()).item()
        assert err <= 1e-5, f"decode {step}: {err:.2e}"
