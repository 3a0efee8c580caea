"""Pi0.5 against lerobot's own implementation (``lerobot==0.6.1``), recorded once in a Python
3.12 environment of its own by ``record_reference.py`` beside this file (lerobot cannot be
installed beside our torch): whole action chunks of ``PI05Pytorch.sample_actions`` for fixed
noise over three observation sets (both cameras; the wrist camera absent, which lerobot pads and
masks; a batch of two with different prompts), and the prompts lerobot's processor writes for
given tasks and normalised states."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.model.pi05.checkpoint import make_name_map
from mstar.model.pi05.config import GemmaDims, Pi05Config, SiglipDims
from mstar.model.pi05.model import prompt_text
from mstar.model.pi05.modeling import Pi05Policy
from mstar.model.weights import load_weights

FIXTURE = Path(__file__).parent / "fixtures" / "lerobot.pt"


def weights(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """``record_reference.weights``: the same draw, by name."""
    values = np.random.RandomState(zlib.crc32(name.encode())).standard_normal(shape).astype(np.float32) * 0.1
    if "vision_tower" in name and "norm" in name and name.endswith("weight"):
        values += 1.0
    return values


@pytest.fixture(scope="module")
def recorded() -> dict:
    return torch.load(FIXTURE)


@pytest.fixture(scope="module")
def model(recorded) -> Pi05Policy:
    dims = recorded["dims"]

    def gemma(d):
        return GemmaDims(d["width"], d["mlp_dim"], d["depth"], d["num_heads"], d["num_kv_heads"], d["head_dim"])

    v = dims["vision"]
    vision = SiglipDims(hidden_size=v["hidden_size"], intermediate_size=4304, num_layers=v["num_hidden_layers"],
                        num_heads=v["num_attention_heads"], image_size=v["image_size"], patch_size=v["patch_size"])
    config = Pi05Config(vision=vision, text=gemma(dims["text"]), expert=gemma(dims["expert"]),
                        chunk_size=dims["chunk"], max_action_dim=dims["max_dim"], max_state_dim=dims["max_dim"],
                        num_inference_steps=dims["steps"], state_dim=dims["max_dim"], action_dim=dims["max_dim"])
    policy = Pi05Policy(config)
    tensors = ((name, torch.from_numpy(weights(name, tuple(shape)))) for name, shape in recorded["shapes"].items())
    assert recorded["embed_source"] == ["paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"]
    with torch.no_grad():  # every lerobot tensor loads and fills every parameter (coverage both ways)
        load_weights(policy, tensors, name_map=make_name_map(embedding_stored=True))
    return policy.eval()


@pytest.mark.parametrize("name", ["both cameras", "wrist absent", "batch of two"])
def test_chunks_equal_lerobot(recorded, model, name: str) -> None:
    case = recorded["sets"][name]
    batch = case["tokens"].shape[0]
    pixels = [torch.stack([img[b] for img, mask in zip(case["images"], case["image_masks"], strict=True) if mask[b]])
              for b in range(batch)]
    ids = [case["tokens"][b][case["token_masks"][b]] for b in range(batch)]
    got = model.sample_actions(pixels, ids, case["noise"], num_steps=recorded["dims"]["steps"], page_size=4)
    want = case["actions"]
    assert float((want - case["noise"]).abs().max()) > 0.5  # the flow moved the noise
    assert float((got - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))
    for b in range(batch):  # each request alone, too
        alone = model.sample_actions(pixels[b:b + 1], ids[b:b + 1], case["noise"][b:b + 1],
                                     num_steps=recorded["dims"]["steps"], page_size=4)
        assert float((alone[0] - want[b]).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))


def test_prompts_equal_lerobot(recorded) -> None:
    p = recorded["prompts"]
    for task, state, want in zip(p["tasks"], p["states"], p["prompts"], strict=True):
        assert prompt_text(task, state) == want
