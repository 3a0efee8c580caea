"""The Cosmos3-Edge reasoner against transformers 5.25's ``Cosmos3EdgeForConditionalGeneration``
on a tiny random config, float32 on the CPU: our vision tower and projector (loaded from a
``reasoner/`` folder of the reference's own tensors) and the generator tower's understanding
expert as a causal LM on the autoregressive engine over paged KV. Prefill and every greedy
decode step's logits within 1e-5 of the reference's (with its cache), for a prompt with an
image, one with a two-frame video and a text-only one, run together in one engine (they share
every decode step); the reference's image processor's patches equal ours; checkpoint
coverage both ways."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.model.cosmos3.config import Cosmos3Config
from mstar.model.cosmos3.reasoner import (
    Cosmos3Reasoner,
    Cosmos3Vision,
    ReasonerConfig,
    ReasonerForward,
    image_patches,
    rope_positions,
    vision_fn,
)
from mstar.model.cosmos3.transformer import Cosmos3Transformer
from mstar.model.weights import WeightLoadError
from tests.support.diffusers_dirs import randomize

pytest.importorskip("transformers")

IMAGE, VIDEO, START, END = 19, 18, 20, 21
VOCAB = 64
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, hidden_act="relu2",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]})
VISION = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
              num_patches=16, spatial_merge_size=2)
REASONER = dict(projector_hidden_size=36, image_token_id=IMAGE, video_token_id=VIDEO,
                vision_start_token_id=START, vision_end_token_id=END)
TOWER = dict(head_dim=16, hidden_size=32, intermediate_size=48, latent_channel=4, latent_patch_size=2,
             num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16,
             rope_theta=10000.0, vocab_size=VOCAB, rope_axes_dim=[4, 2, 2], rms_norm_eps=1e-6, hidden_act="relu2",
             qk_norm_for_text=False, use_und_k_norm_for_gen=True)
RENAME = {".self_attn.to_q.": ".self_attn.q_proj.", ".self_attn.to_k.": ".self_attn.k_proj.",
          ".self_attn.to_v.": ".self_attn.v_proj.", ".self_attn.to_out.": ".self_attn.o_proj.",
          ".mlp.up_proj.": ".mlp.fc1.", ".mlp.down_proj.": ".mlp.fc2."}
PIXELS = dict(min_pixels=8 * 8, max_pixels=32 * 32)
STEPS = 5


def reference_name(ours: str) -> str | None:
    """Our tower's understanding-expert name -> the reference's (None: a generator tensor)."""
    if ours == "lm_head.weight":
        return ours
    if not (ours.startswith(("embed_tokens.", "norm.")) or ours.startswith("layers.")):
        return None
    if "_moe_gen" in ours or ".add_" in ours or "to_add_out" in ours or "norm_added" in ours \
            or "k_norm_und_for_gen" in ours:
        return None
    for old, new in RENAME.items():
        ours = ours.replace(old, new)
    return "model.language_model." + ours


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import Cosmos3EdgeConfig, Cosmos3EdgeForConditionalGeneration

    torch.manual_seed(0)
    config = Cosmos3EdgeConfig(text_config=TEXT, vision_config=VISION, **REASONER)
    config._attn_implementation = "eager"
    ref = Cosmos3EdgeForConditionalGeneration(config).eval()
    randomize(ref, 0)
    tower = Cosmos3Transformer(Cosmos3Config.from_dict(TOWER)).eval()
    randomize(tower, 1)  # the generation expert: random, unread by the reasoner
    ref_state = ref.state_dict()
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if (ref_name := reference_name(name)) is not None:
                p.copy_(ref_state[ref_name])
    root = tmp_path_factory.mktemp("edge")
    (root / "reasoner").mkdir()
    (root / "reasoner" / "config.json").write_text(json.dumps(config.to_dict()))
    vision_state = {k.removeprefix("model."): v.contiguous() for k, v in ref_state.items()
                    if k.startswith(("model.visual.", "model.projector."))}
    save_file(vision_state, root / "reasoner" / "model.safetensors")
    vision = Cosmos3Vision.load(root, TOWER["hidden_size"], device="cpu", dtype=torch.float32, dummy=False, seed=0)
    return ref, tower, vision, root, vision_state


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8).numpy())


def test_image_patches_match_the_reference_processor(models):
    from transformers.models.cosmos3_edge.image_processing_pil_cosmos3_edge import Cosmos3EdgeImageProcessorPil

    _, _, vision, _, _ = models
    processor = Cosmos3EdgeImageProcessorPil(patch_size=4, merge_size=2,
                                             size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32})
    for size in [(21, 13), (40, 30), (7, 50)]:
        image = picture(sum(size), size)
        ref = processor(images=[image], return_tensors="pt")
        patches, grid = image_patches(image, vision.config, **PIXELS)
        assert grid == tuple(ref["image_grid_thw"][0].tolist())
        torch.testing.assert_close(patches, ref["pixel_values"].float(), atol=1e-6, rtol=0)


def prompts(vision: Cosmos3Vision):
    """Three chats: (ids, mm_token_type_ids, pixel kwargs for the reference, our vision inputs)."""
    image, igrid = image_patches(picture(1, (20, 12)), vision.config, **PIXELS)
    n = vision.num_tokens(igrid)
    ids = [1, 5, 7, START, *[IMAGE] * n, END, 9, 33, 41]
    yield ("image", ids, {"pixel_values": image, "image_grid_thw": torch.tensor([igrid])},
           {"pixel_values": image, "grid_thw": torch.tensor([igrid])})
    frames = [image_patches(picture(10 + i, (16, 16)), vision.config, **PIXELS) for i in range(2)]
    (f0, g), (f1, _) = frames
    clip, vgrid = torch.cat([f0, f1]), (2, g[1], g[2])
    per = vision.num_tokens(g)
    ids = [1, 6, 42, 43, START, *[VIDEO] * per, END, 44, 45, START, *[VIDEO] * per, END, 12, 13]
    yield ("video", ids, {"pixel_values_videos": clip, "video_grid_thw": torch.tensor([vgrid])},
           {"pixel_values": clip, "grid_thw": torch.tensor([vgrid])})
    yield "text", [1, 3, 8, 22, 50, 2], {}, None


def reference_run(ref, ids: list[int], pixels: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The prefill's logits at every prompt position, and the last-position logits of the
    prefill and of ``STEPS - 1`` greedy decodes, with the reference's own cache and positions."""
    ref.model.rope_deltas = None
    input_ids = torch.tensor([ids])
    kinds = torch.zeros_like(input_ids, dtype=torch.int32)
    kinds[input_ids == IMAGE], kinds[input_ids == VIDEO] = 1, 2
    with torch.no_grad():
        out = ref(input_ids=input_ids, mm_token_type_ids=kinds, use_cache=True, **pixels)
        prompt = out.logits[0]
        logits = [out.logits[0, -1]]
        for _ in range(STEPS - 1):
            token = logits[-1].argmax().view(1, 1)
            out = ref(input_ids=token, cache=out.cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return prompt, logits


class Recording(ReasonerForward):
    """Keeps every step's logits and the prefill step's hidden states of every prompt position."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seen: list[torch.Tensor] = []
        self.prefill: list[torch.Tensor] = []

    def hidden(self, input_ids, meta, kv_caches, inputs, counts):
        out = super().hidden(input_ids, meta, kv_caches, inputs, counts)
        if not self.prefill:
            bounds = meta.query_starts
            self.prefill = [out[bounds[i]:bounds[i + 1]].clone() for i in range(len(bounds) - 1)]
        return out

    def logits(self, hidden):
        out = super().logits(hidden)
        self.seen.append(out.detach().clone())
        return out


def test_reasoner_logits_every_step(models):
    ref, tower, vision, _, _ = models
    chats = list(prompts(vision))
    runs = {name: reference_run(ref, ids, pixels) for name, ids, pixels, _ in chats}
    expected = {name: steps for name, (_, steps) in runs.items()}
    reasoner = Cosmos3Reasoner(tower)
    forward = Recording(reasoner, (IMAGE, VIDEO))
    engine = AutoregressiveEngine(reasoner, KVLayout(*reasoner.cache_shape()), num_pages=64, page_size=4,
                                  max_seq_len=256, device=torch.device("cpu"), dtype=torch.float32, forward=forward)
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": STEPS, "stop_token_ids": []}
    items = []
    for name, ids, _, inputs in chats:
        prompt = torch.tensor(ids)
        step = {"prompt_ids": prompt}
        if inputs is not None:
            (embeds,) = vision_fn(vision)("run", [EngineItem(name, "run", 0, inputs, {})])
            grids = [tuple(g) for g in inputs["grid_thw"].tolist()]
            step.update(embeds, rope_positions=rope_positions(prompt, grids, (IMAGE, VIDEO), 2))
        items.append(EngineItem(name, "prefill", 0, step, params))
    names = [name for name, *_ in chats]
    got: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    with torch.no_grad():
        tokens = {item.request_id: [int(out.outputs["token"])] for item, out in zip(items, engine.run(items))}
        for row, name in enumerate(names):
            got[name].append(forward.seen[-1][row])
        for _ in range(STEPS - 1):
            decodes = [EngineItem(n, "decode", 0, {"token": torch.tensor([tokens[n][-1]])}, {}) for n in names]
            for n, out in zip(names, engine.run(decodes)):
                tokens[n].append(int(out.outputs["token"]))
            for row, name in enumerate(names):
                got[name].append(forward.seen[-1][row])
    worst = 0.0
    for name, hidden in zip(names, forward.prefill, strict=True):  # every prompt position
        with torch.no_grad():
            ours = reasoner.compute_logits(hidden.clone())
        torch.testing.assert_close(ours, runs[name][0], atol=1e-5, rtol=1e-5)
        worst = max(worst, float((ours - runs[name][0]).abs().max()))
    for name in names:
        assert tokens[name] == [int(x.argmax()) for x in expected[name]], name
        for ours, theirs in zip(got[name], expected[name], strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
            worst = max(worst, float((ours - theirs).abs().max()))
    print(f"worst logit difference {worst:.2e}")


def test_one_copy_of_the_understanding_weights(models):
    _, tower, _, _, _ = models
    reasoner = Cosmos3Reasoner(tower)
    assert reasoner.tower.layers[0].self_attn.to_q.weight is tower.layers[0].self_attn.to_q.weight
    assert reasoner.compute_logits(torch.zeros(1, 32)).shape == (1, VOCAB)


def test_vision_checkpoint_coverage_both_ways(models, tmp_path):
    _, _, _, root, state = models
    (tmp_path / "reasoner").mkdir()
    (tmp_path / "reasoner" / "config.json").write_text((root / "reasoner" / "config.json").read_text())
    for broken, needle in [({k: v for k, v in state.items() if k != "projector.linear_fc2.bias"},
                            "projector.linear_fc2.bias"),
                           ({**state, "visual.extra.weight": torch.zeros(2)}, "visual.extra.weight")]:
        save_file(broken, tmp_path / "reasoner" / "model.safetensors")
        with pytest.raises(WeightLoadError, match=needle.replace(".", r"\.")):
            Cosmos3Vision.load(tmp_path, 32, device="cpu", dtype=torch.float32, dummy=False, seed=0)


def test_no_reasoner_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="reasoner"):
        Cosmos3Vision.read_config(tmp_path, 32)


def test_rope_positions_refuse_a_grid_mismatch():
    ids = torch.tensor([1, START, IMAGE, IMAGE, END])
    with pytest.raises(ValueError, match="grid"):
        rope_positions(ids, [(1, 4, 4)], (IMAGE, VIDEO), 2)
    config = ReasonerConfig.from_dict({"vision_config": VISION, **REASONER}, 32)
    assert (config.patch_size, config.spatial_merge_size, config.text_hidden_size) == (4, 2, 32)


def test_only_edge_serves_chat():
    from mstar.model.registry import model_class

    for key in ("cosmos3", "cosmos3_super", "cosmos3_super_t2i_4step", "cosmos3_super_i2v_4step"):
        assert "chat" not in model_class(key).tasks, key
    edge = model_class("cosmos3_edge")
    assert "chat" in edge.tasks and {"image", "video"} <= edge.input_modalities


def test_video_frames_sampled_and_patched_as_the_reference():
    """The video processor's rules (its module needs torchvision, absent here, so its formulas
    are checked by value): 2 frames a second of the source rate, at least 4, evenly spread; one
    size for the clip; frames already at that size patched exactly as images."""
    from mstar.model.cosmos3.reasoner import sample_frames, video_patches

    assert sample_frames(50, 25.0, 2.0) == [0, 16, 33, 49]  # int(50 / 25 * 2) = 4
    assert sample_frames(240, 24.0, 2.0) == [round(i * 239 / 19) for i in range(20)]
    assert sample_frames(3, 24.0, 2.0) == [0, 1, 2]  # never more than the clip has
    assert sample_frames(100, None, 2.0, max_frames=5) == [0, 25, 50, 74, 99]  # 24 fps assumed; capped
    config = ReasonerConfig.from_dict({"vision_config": VISION, **REASONER}, 32)
    frames = torch.randint(0, 256, (3, 16, 24, 3), dtype=torch.uint8)
    patches, grid = video_patches(frames, config, min_pixels=8 * 8, max_pixels=3 * 32 * 32)
    assert grid == (3, 4, 6)
    expected = torch.cat([image_patches(Image.fromarray(f.numpy()), config, **PIXELS)[0] for f in frames])
    torch.testing.assert_close(patches, expected, atol=1e-6, rtol=0)
    _, small = video_patches(frames, config, min_pixels=8 * 8, max_pixels=3 * 8 * 16)
    assert small == (3, 2, 2)  # the whole clip's area is capped: beta = sqrt(3), 8 x 8 frames


def test_edge_without_a_reasoner_folder_refuses_chat(checkpoint):
    """A checkpoint without ``reasoner/`` still loads its frontend (generation is served) and
    answers a chat with a 400 naming the model."""
    from mstar.config import parse_config
    from mstar.contract import ChatSpec, RequestError, SamplingParams
    from mstar.model.registry import model_class

    spec = model_class("cosmos3_edge")(parse_config({"model": "cosmos3_edge", "model_path": str(checkpoint.root),
                                                     "load_format": "dummy"}))
    spec.load_frontend()
    assert spec.reasoner_config is None
    with pytest.raises(RequestError) as err:
        spec.prepare_chat(ChatSpec("r", [{"role": "user", "content": "hi"}], SamplingParams(), 4))
    assert err.value.field == "model" and err.value.status == 400 and "cosmos3_edge" in err.value.message
