"""Record ``tests/model/pi05/fixtures/lerobot.pt``: lerobot's own Pi0.5 (``lerobot==0.6.1``,
``PI05Pytorch.sample_actions``) on a tiny configuration, for ``test_pi05_lerobot.py`` (a script,
not collected by pytest).

lerobot 0.6.1 needs Python >= 3.12 and its own torch/transformers pins, so it records in a venv
of its own (it ran with torch 2.11.0, transformers 5.5.4)::

    ~/.pyenv/versions/3.12.1/bin/python -m venv /tmp/venv312
    /tmp/venv312/bin/pip install "lerobot[pi]==0.6.1"
    /tmp/venv312/bin/python tests/model/pi05/record_reference.py

lerobot sizes its two Gemmas by variant name only (``gemma_2b``, ``gemma_300m``) and builds
PaliGemma's SigLIP at its released width; this script hands its module tiny ones (``TEXT``,
``EXPERT``, ``VISION`` below: the module's ``get_gemma_config`` and ``CONFIG_MAPPING`` are
replaced for the recording only). lerobot still forces the vocabulary (257152) and SigLIP's MLP
width (4304), and its projector's output is set to the tiny text width after it is built. No
weights are stored: every tensor of the released key layout is drawn from ``weights(name,
shape)`` (numpy, seeded by the name), which the test draws again.

The fixture holds, per observation set: the camera images and their masks (an absent camera is
all -1 and masked, as lerobot pads it), the padded prompt tokens and their mask, the noise and
lerobot's chunk; and a few states with the prompt lerobot's ``Pi05PrepareStateTokenizerProcessorStep``
makes of them.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
import torch

FIXTURE = Path(__file__).parent / "fixtures" / "lerobot.pt"
TEXT = dict(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16)
EXPERT = dict(width=24, depth=2, mlp_dim=48, num_heads=2, num_kv_heads=1, head_dim=16)
VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=4, image_size=16)
CHUNK, MAX_DIM, STEPS, MAX_TOKENS = 6, 8, 4, 24


def weights(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tiny model's tensor ``name``: N(0, 0.1), SigLIP's LayerNorm scales around 1."""
    values = np.random.RandomState(zlib.crc32(name.encode())).standard_normal(shape).astype(np.float32) * 0.1
    if "vision_tower" in name and "norm" in name and name.endswith("weight"):
        values += 1.0
    return values


def observation_sets():
    """(cameras present, prompt length, seed) per set: both cameras; the wrist camera absent;
    a batch of two with different prompts."""
    return {"both cameras": [(2, 17, 1)], "wrist absent": [(1, 9, 2)], "batch of two": [(2, 21, 3), (1, 12, 4)]}


def inputs_for(spec):
    images, image_masks, tokens, token_masks = [[], []], [[], []], [], []
    for present, length, seed in spec:
        g = np.random.RandomState(100 + seed)
        for cam in range(2):
            if cam < present:
                images[cam].append(torch.from_numpy(g.uniform(-1, 1, (3, 16, 16)).astype(np.float32)))
            else:
                images[cam].append(-torch.ones(3, 16, 16))
            image_masks[cam].append(cam < present)
        ids = np.zeros(MAX_TOKENS, dtype=np.int64)
        ids[:length] = g.randint(1, 1000, length)
        tokens.append(torch.from_numpy(ids))
        token_masks.append(torch.arange(MAX_TOKENS) < length)
    noise = torch.from_numpy(np.random.RandomState(7 + spec[0][2]).standard_normal(
        (len(spec), CHUNK, MAX_DIM)).astype(np.float32))
    return ([torch.stack(i) for i in images], [torch.tensor(m) for m in image_masks], torch.stack(tokens),
            torch.stack(token_masks), noise)


def main() -> None:
    import lerobot.policies.pi05.modeling_pi05 as lerobot_pi05
    import transformers
    from lerobot.lerobot_types import TransitionKey
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep
    from transformers.models.auto import CONFIG_MAPPING

    variants = {"gemma_2b": lerobot_pi05.GemmaConfig(**TEXT), "gemma_300m": lerobot_pi05.GemmaConfig(**EXPERT)}
    lerobot_pi05.get_gemma_config = variants.__getitem__

    class TinyMapping(dict):
        def __getitem__(self, key):
            if key == "paligemma":
                return lambda: CONFIG_MAPPING["paligemma"](vision_config={"model_type": "siglip_vision_model",
                                                                          "vision_use_head": False, **VISION})
            return CONFIG_MAPPING[key]

    lerobot_pi05.CONFIG_MAPPING = TinyMapping()
    config = PI05Config(chunk_size=CHUNK, n_action_steps=CHUNK, max_state_dim=MAX_DIM, max_action_dim=MAX_DIM,
                        num_inference_steps=STEPS, image_resolution=(16, 16), tokenizer_max_length=MAX_TOKENS,
                        dtype="float32", device="cpu")
    model = lerobot_pi05.PI05Pytorch(config).eval()
    # lerobot fixes the projector's output at 2048 (the released text width): make it the tiny one
    projector = model.paligemma_with_expert.paligemma.model.multi_modal_projector
    projector.linear = torch.nn.Linear(VISION["hidden_size"], TEXT["width"])
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(torch.from_numpy(weights(name, tuple(tensor.shape))))
    shapes = {name: list(t.shape) for name, t in state.items()}
    # PaliGemma ties its embedding to lm_head: both names are in the state dict, one storage
    embed = model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight
    embed_source = [n for n in shapes if n.endswith("embed_tokens.weight") or n.endswith("paligemma.lm_head.weight")
                    if np.array_equal(embed.detach().numpy(), weights(n, tuple(shapes[n])))]

    sets = {}
    for name, spec in observation_sets().items():
        images, image_masks, tokens, token_masks, noise = inputs_for(spec)
        with torch.no_grad():
            actions = model.sample_actions(images, image_masks, tokens, token_masks, noise=noise.clone(),
                                           num_steps=STEPS)
        sets[name] = {"images": images, "image_masks": image_masks, "tokens": tokens, "token_masks": token_masks,
                      "noise": noise, "actions": actions}
        print(f"{name}: actions {tuple(actions.shape)}, |actions - noise| {float((actions - noise).abs().max()):.3f}")

    states = torch.tensor([[-1.2, -1.0, -0.99, 0.0], [0.003, 0.5, 0.999, 1.0], [0.25, -0.5, 2.0, -0.0078125]])
    step = Pi05PrepareStateTokenizerProcessorStep(max_state_dim=MAX_DIM)
    transition = {TransitionKey.OBSERVATION: {"observation.state": states},
                  TransitionKey.COMPLEMENTARY_DATA: {"task": ["pick_up the\ncube ", "wave", " stack  blocks"]}}
    prompts = step(transition)[TransitionKey.COMPLEMENTARY_DATA]["task"]

    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    versions = {"lerobot": "0.6.1", "torch": str(torch.__version__), "transformers": transformers.__version__,
                "python": sys.version.split()[0]}
    torch.save({"versions": versions,
                "dims": {"text": TEXT, "expert": EXPERT, "vision": VISION, "chunk": CHUNK, "max_dim": MAX_DIM,
                         "steps": STEPS},
                "shapes": shapes, "embed_source": embed_source, "sets": sets,
                "prompts": {"states": states, "tasks": ["pick_up the\ncube ", "wave", " stack  blocks"],
                            "prompts": prompts}}, FIXTURE)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
