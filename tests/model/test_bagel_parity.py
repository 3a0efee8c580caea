"""BAGEL's understanding side against the official code (``bagel2``), tiny random model, float32
on the CPU: the 2D position table, the vision tower on two images of different sizes, one
MoT layer over a step mixing understanding and generation tokens on a cached prefix, and
the whole model reading an image and a prompt then decoding greedily over the paged cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.bagel.config import BagelConfig
from mstar.model.bagel.llm import BagelLanguageModel, MoTDecoderLayer, TokenSplit, attention_positions
from mstar.model.bagel.prompt import SpecialTokens, layout
from mstar.model.bagel.vision import BagelVision, patch_positions, patchify, sincos_table
from tests.support.bagel_reference import LLM, TOKENS, VIT, NaiveCache, reference_bagel, reference_chat_logits
from tests.support.pages import Pages

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TOL = 1e-5
SPECIAL = SpecialTokens(TOKENS["bos_token_id"], TOKENS["eos_token_id"], TOKENS["start_of_image"],
                        TOKENS["end_of_image"])


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def ref():
    return reference_bagel(seed=0)


@pytest.fixture(scope="module")
def config() -> BagelConfig:
    vit = dict(VIT, num_hidden_layers=VIT["num_hidden_layers"] + 1)  # the file counts one layer more
    return BagelConfig.from_dicts(LLM, vit, {"vit_max_num_patch_per_side": 8})


def sub_state(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in model.state_dict().items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def ours(ref, config):
    llm = BagelLanguageModel(config.llm)
    llm.load_state_dict(sub_state(ref, "language_model."))
    vision = BagelVision(config)
    vision.load_state_dict({k: v for k, v in ref.state_dict().items() if k.startswith(("vit_model.", "connector."))})
    assert torch.equal(vision.vit_pos_embed.pos_embed, ref.vit_pos_embed.pos_embed)  # made, not loaded
    return llm.eval(), vision.eval()


def images() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(3, 16, 24, generator=gen), torch.randn(3, 32, 12, generator=gen)]


def test_position_table_is_bagels_sincos():
    from bagel2.modeling.bagel.modeling_utils import PositionEmbedding

    for side, dim in ((8, 64), (5, 32)):
        assert torch.equal(sincos_table(side, dim), PositionEmbedding(side, dim).pos_embed.data)


def test_vision_tower_two_sizes(ref, ours):
    from bagel2.data.data_utils import get_flattened_position_ids_extrapolate
    from bagel2.data.data_utils import patchify as ref_patchify

    _, vision = ours
    imgs = images()
    patches, positions, lengths = [], [], []
    for img in imgs:
        p, pos = vision.image_tokens(img)
        assert torch.equal(p, ref_patchify(img, 4))
        assert torch.equal(pos, get_flattened_position_ids_extrapolate(img.shape[1], img.shape[2], 4, 8))
        patches.append(p), positions.append(pos), lengths.append(len(pos))
    patches, positions = torch.cat(patches), torch.cat(positions)
    with torch.no_grad():
        cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
        feats = ref.vit_model(packed_pixel_values=patches, packed_flattened_position_ids=positions, cu_seqlens=cu,
                              max_seqlen=max(lengths))
        expected = ref.connector(feats) + ref.vit_pos_embed(positions)
        got = vision(patches, positions, lengths)
    assert got.shape == (24 + 24, LLM["hidden_size"])
    assert rel_err(got, expected) < TOL
    with torch.no_grad():  # each image alone gives the same rows: images do not see each other
        alone = vision(patches[:24], positions[:24], [24])
    assert rel_err(alone, got[:24]) < TOL


def test_patch_grid_limit():
    with pytest.raises(ValueError, match="9x2 patches"):
        patch_positions(36, 8, 4, 8)
    with pytest.raises(ValueError, match="multiples"):
        patchify(torch.zeros(3, 10, 8), 4)


def test_mot_layer_mixed_tokens(ref, config):
    """A causal text prefix through one layer (understanding weights), then a block of six tokens
    that attend both ways, three of them generation tokens (interleaved), on the cached prefix:
    the reference's ``mode="gen"`` step."""
    ref_layer = ref.language_model.model.layers[0]
    layer = MoTDecoderLayer(config.llm).eval()
    layer.load_state_dict(ref_layer.state_dict())
    rotary = ref.language_model.model.rotary_emb
    ours_rotary = BagelLanguageModel(config.llm).model.rotary
    gen = torch.Generator().manual_seed(2)
    prefix, block = torch.randn(5, 64, generator=gen), torch.randn(6, 64, generator=gen)
    generation = torch.tensor([False, True, True, False, True, False])
    rope_prefix, rope_block = torch.arange(5), torch.full((6,), 5)

    cache = NaiveCache(1)
    with torch.no_grad():
        cos, sin = (t.squeeze(0) for t in rotary(prefix, rope_prefix[None]))
        ref_prefix, cache = ref_layer.forward_inference(
            prefix, query_lens=torch.tensor([5]), packed_query_position_embeddings=(cos, sin),
            packed_query_indexes=torch.arange(5), past_key_values=cache, key_values_lens=torch.tensor([0]),
            packed_key_value_indexes=torch.arange(0), is_causal=True, mode="und")
        cos, sin = (t.squeeze(0) for t in rotary(block, rope_block[None]))
        ref_block, cache = ref_layer.forward_inference(
            block, query_lens=torch.tensor([6]), packed_query_position_embeddings=(cos, sin),
            packed_query_indexes=torch.arange(5, 11), past_key_values=cache, key_values_lens=torch.tensor([5]),
            packed_key_value_indexes=torch.arange(5), is_causal=False, mode="gen",
            packed_vae_token_indexes=generation.nonzero().flatten(),
            packed_text_indexes=(~generation).nonzero().flatten())

    pages = Pages(num_pages=8, page_size=4)
    (kv,) = allocate_kv_cache(1, 8, 4, 2, 16, torch.float32, "cpu")
    with torch.no_grad():
        meta = dataclasses.replace(pages.step([("a", 5)]), positions=attention_positions(0, 5, causal=True))
        cos, sin = ours_rotary.cos_sin(rope_prefix, torch.float32)
        got_prefix = layer(prefix, TokenSplit.of(None, 5, prefix.device), cos, sin, kv, meta)
        meta = dataclasses.replace(pages.step([("a", 6)]), positions=attention_positions(5, 6, causal=False))
        cos, sin = ours_rotary.cos_sin(rope_block, torch.float32)
        got_block = layer(block, TokenSplit.of(generation, 6, block.device), cos, sin, kv, meta)
    assert rel_err(got_prefix, ref_prefix) < TOL
    assert rel_err(got_block, ref_block) < TOL
    # the generation rows did take the generation weights: the understanding ones give another answer
    with torch.no_grad():
        und_only = layer(block, TokenSplit.of(None, 6, block.device), cos, sin, kv, meta)
    assert rel_err(und_only[1], ref_block[1]) > 1e-3


def run_chat(llm: BagelLanguageModel, vision: BagelVision, blocks: list, steps: int):
    """Ours: the prompt's blocks (images ``[3, H, W]`` and texts) as one prefill over the paged
    cache, then ``steps`` greedy decodes from ``<|im_start|>``. Returns the decode logits and the
    fed tokens."""
    parts = [vision.image_tokens(b) for b in blocks if isinstance(b, torch.Tensor)]
    counts = iter([len(q) for _, q in parts])
    plan = layout([next(counts) if isinstance(b, torch.Tensor) else b for b in blocks], SPECIAL)
    pages = Pages(num_pages=32, page_size=4, seed=3)
    kv = allocate_kv_cache(2, 32, 4, 2, 16, torch.float32, "cpu")
    with torch.no_grad():
        embeds = llm.embed(plan.token_ids)
        if parts:
            embeds[plan.vision_rows] = vision(torch.cat([p for p, _ in parts]), torch.cat([q for _, q in parts]),
                                              [len(q) for _, q in parts])
        meta = dataclasses.replace(pages.step([("a", len(plan))]), positions=plan.mask_positions)
        llm(embeds, plan.rope_positions, kv, meta)
        token, rope, logits, fed = SPECIAL.im_start, plan.next_rope, [], []
        for i in range(steps):
            fed.append(token)
            meta = dataclasses.replace(pages.step([("a", 1)]), positions=torch.tensor([len(plan) + i]))
            hidden = llm(llm.embed(torch.tensor([token])), torch.tensor([rope + i]), kv, meta)
            logits.append(llm.compute_logits(hidden))
            token = int(logits[-1].argmax())
    return torch.cat(logits), fed


@pytest.mark.parametrize("order", ["images_then_text", "interleaved", "text_only"])
def test_understanding_logits_and_greedy_decode(ref, ours, order):
    llm, vision = ours
    first, second = images()
    blocks = {"images_then_text": [first, second, [5, 17, 33, 2, 60, 71, 8]],
              "interleaved": [[12, 13], first, [5, 17, 33], second, [60, 71, 8]],
              "text_only": [[12, 13, 14], [5, 17, 33, 2]]}[order]
    expected, ref_fed = reference_chat_logits(ref, blocks, steps=3)
    got, fed = run_chat(llm, vision, blocks, steps=3)
    assert fed == ref_fed
    assert rel_err(got, expected) < TOL


def test_serving_engine_matches_reference_greedy(ref, ours):
    """The served path: the vision node's function and the autoregressive engine with BAGEL's
    forward side, two requests (one with two images, one text only) prefilled in one step and
    decoded together, each giving the reference's greedy tokens."""
    from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
    from mstar.engine.base import EngineItem
    from mstar.model.bagel.engine import BagelForward, vision_fn

    llm, vision = ours
    steps = 6
    prompts = {"img": [[40, 2], *images(), [5, 17, 33, 2, 60]], "txt": [[40, 41, 7]]}
    expected = {rid: reference_chat_logits(ref, blocks, steps + 1)[1][1:]  # it feeds, we sample
                for rid, blocks in prompts.items()}
    engine = AutoregressiveEngine(llm, KVLayout(*llm.cache_shape()), num_pages=32, page_size=4, max_seq_len=128,
                                  device=torch.device("cpu"), dtype=torch.float32, forward=BagelForward(llm))
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": steps, "stop_token_ids": []}
    items = []
    for rid, blocks in prompts.items():
        parts = [vision.image_tokens(b) for b in blocks if isinstance(b, torch.Tensor)]
        counts = iter([len(q) for _, q in parts])
        plan = layout([next(counts) if isinstance(b, torch.Tensor) else b for b in blocks], SPECIAL, answer=True)
        inputs = {"prompt_ids": plan.token_ids}
        if parts:
            vision_inputs = {"patches": torch.cat([p for p, _ in parts]),
                             "patch_positions": torch.cat([q for _, q in parts]),
                             "patch_counts": torch.tensor([len(q) for _, q in parts])}
            (embeds,) = vision_fn(vision)("run", [EngineItem(rid, "run", 0, vision_inputs, {})])
            inputs.update(embeds, vision_rows=plan.vision_rows, rope_positions=plan.rope_positions,
                          mask_positions=plan.mask_positions)
        items.append(EngineItem(rid, "prefill", 0, inputs, params))
    with torch.no_grad():
        tokens = {item.request_id: [int(out.outputs["token"])] for item, out in zip(items, engine.run(items))}
        for _ in range(steps - 1):
            decodes = [EngineItem(rid, "decode", 0, {"token": torch.tensor([t[-1]])}, {}) for rid, t in tokens.items()]
            for rid, out in zip(tokens, engine.run(decodes)):
                tokens[rid].append(int(out.outputs["token"]))
    assert tokens == expected


@pytest.mark.parametrize(("size", "first", "second"), [
    ((300, 200), (768, 512), (770, 518)),  # raised to the shortest side, then rounded to 14
    ((50, 80), (512, 816), (518, 812)),
    ((2000, 900), (1024, 464), (980, 448)),  # the longest side capped twice
    ((224, 3000), (80, 1024), (70, 980)),
])
def test_resize_rules(size, first, second):
    """BAGEL's two resizes (the inferencer's VAE-side one, then the tower's), worked out by
    hand from the reference's rules (its transforms need torchvision and cv2, not installed)."""
    from mstar.model.bagel.vision import VAE_RESIZE, VAE_STRIDE, VIT_RESIZE, resized_size

    assert resized_size(*size, *VAE_RESIZE, VAE_STRIDE) == first
    assert resized_size(*first, *VIT_RESIZE, 14) == second


def test_preprocess_rgb_range_and_transparency():
    from PIL import Image

    from mstar.model.bagel.vision import preprocess

    clear = Image.new("RGBA", (40, 28), (10, 20, 30, 0))  # fully transparent: white
    pixels = preprocess(clear, 4, (32, 16), (64, 32))
    assert pixels.shape == (3, 20, 32) and torch.allclose(pixels, torch.ones_like(pixels))
    black = preprocess(Image.new("L", (20, 20), 0), 4, (32, 16), (64, 32))
    assert black.shape == (3, 32, 32) and torch.allclose(black, -torch.ones_like(black))
