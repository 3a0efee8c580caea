"""Record the official V-JEPA 2-AC modules' outputs for ``tests/model/test_vjepa2_parity.py``.

The reference is ``cc-vjepa2==0.0.3`` (the PyPI packaging of facebookresearch/vjepa2). It does not
install beside our torch without pulling timm and torchvision, so it runs in its own
environment once and the test compares against what it wrote::

    python -m pip install --no-deps --target /tmp/vjref cc-vjepa2==0.0.3 einops
    PYTHONPATH=/tmp/vjref:. python tests/model/vjepa2/record_reference.py

timm is needed only for ``drop_path`` (unused: drop path 0, eval mode), so a stub stands in when
it is missing. Writes ``ac_reference.safetensors`` beside this file: the tiny encoder's and
predictors' weights in the official key layout (``module.backbone.`` prefixed, as the released
``vjepa2-ac-vitg.pt``), the inputs, and the outputs; the configs are in its metadata.
"""

from __future__ import annotations

import json
import sys
import types
from functools import partial
from pathlib import Path

import torch
from torch import nn

if "timm" not in sys.modules:
    try:
        import timm  # noqa: F401
    except ImportError:
        layers = types.ModuleType("timm.models.layers")
        layers.drop_path = lambda x, p=0.0, training=False: x
        for name, module in (("timm", types.ModuleType("timm")), ("timm.models", types.ModuleType("timm.models")),
                             ("timm.models.layers", layers)):
            sys.modules[name] = module

import vjepa2  # noqa: E402
from vjepa2.models.ac_predictor import vit_ac_predictor  # noqa: E402
from vjepa2.models.vision_transformer import VisionTransformer  # noqa: E402

OUT = Path(__file__).with_name("ac_reference.safetensors")
SIZE, PATCH, TUBELET = 32, 8, 2
ENCODER = {"hidden_size": 48, "num_layers": 2, "num_heads": 3, "mlp_ratio": 2.0, "patch_size": PATCH,
           "tubelet_size": TUBELET, "crop_size": SIZE, "frames_per_clip": 8}
PREDICTORS = {
    "plain": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "mlp_ratio": 4.0, "action_dim": 7,
              "use_extrinsics": False},
    "extrinsics": {"hidden_size": 48, "num_layers": 2, "num_heads": 3, "mlp_ratio": 4.0, "action_dim": 7,
                   "use_extrinsics": True},
}


def scramble(module: nn.Module, seed: int) -> None:
    """Every parameter drawn again, large enough that a wrong rotation or mask shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)


def main() -> None:
    torch.manual_seed(0)
    encoder = VisionTransformer(img_size=(SIZE, SIZE), patch_size=PATCH, num_frames=TUBELET, tubelet_size=TUBELET,
                                embed_dim=48, depth=2, num_heads=3, mlp_ratio=2.0, qkv_bias=True, use_rope=True,
                                use_sdpa=True, norm_layer=partial(nn.LayerNorm, eps=1e-6)).eval()
    scramble(encoder, 1)
    gen = torch.Generator().manual_seed(2)
    batch, frames = 2, 3
    video = torch.randn(batch, frames, 3, SIZE, SIZE, generator=gen)
    clips = video.flatten(0, 1)[:, :, None].repeat(1, 1, TUBELET, 1, 1)  # [B*T, C, tubelet, H, W]
    with torch.no_grad():
        tokens = encoder(clips).view(batch, -1, 48)
    tensors = {"video": video, "encoder_tokens": tokens}
    tensors.update({f"encoder.module.backbone.{k}": v for k, v in encoder.state_dict().items()})
    normed = torch.nn.functional.layer_norm(tokens, (48,))
    actions = torch.randn(batch, frames, 7, generator=gen)
    states = torch.randn(batch, frames, 7, generator=gen)
    extrinsics = torch.randn(batch, frames, 6, generator=gen)
    tensors.update(actions=actions, states=states, extrinsics=extrinsics)
    for i, (name, cfg) in enumerate(PREDICTORS.items()):
        predictor = vit_ac_predictor(img_size=(SIZE, SIZE), patch_size=PATCH, num_frames=ENCODER["frames_per_clip"],
                                     tubelet_size=TUBELET, embed_dim=48, predictor_embed_dim=cfg["hidden_size"],
                                     depth=cfg["num_layers"], num_heads=cfg["num_heads"],
                                     action_embed_dim=cfg["action_dim"], use_extrinsics=cfg["use_extrinsics"]).eval()
        scramble(predictor, 10 + i)
        with torch.no_grad():
            out = predictor(normed, actions, states, extrinsics if cfg["use_extrinsics"] else None)
        tensors[f"{name}.predicted"] = out
        tensors.update({f"{name}.module.backbone.{k}": v for k, v in predictor.state_dict().items()})
    from safetensors.torch import save_file

    meta = {"reference": f"cc-vjepa2=={vjepa2.__version__}", "torch": torch.__version__,
            "encoder": json.dumps(ENCODER), "predictors": json.dumps(PREDICTORS)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(OUT), metadata=meta)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
