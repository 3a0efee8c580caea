"""The reference package, Meta's ``audioseal`` 0.2.0, imported beside our torch.

Installed without its dependencies, with the config library its loader parses cards and
``xp.cfg`` with, into a private folder (see the Makefile)::

    pip install --no-deps --target scratch/audioseal-0.2.0 audioseal==0.2.0 \
        omegaconf==2.3.0 antlr4-python3-runtime==4.9.3

``MSTAR_AUDIOSEAL_REF`` names another folder. Its SEANet modules wrap ``forward`` in a lazy
``torch.compile`` unless ``NO_TORCH_COMPILE`` is set when they are imported, so it is set here.
Tests that need it skip, saying how to install it, when it is absent.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

VERSION = "0.2.0"
ROOT = Path(__file__).resolve().parents[2]
FOLDER = Path(os.environ.get("MSTAR_AUDIOSEAL_REF", ROOT / "scratch" / f"audioseal-{VERSION}"))


def reference():
    """The ``audioseal`` package from the private install (skips the test without it)."""
    if not (FOLDER / "audioseal").is_dir() or not (FOLDER / "omegaconf").is_dir():
        pytest.skip(f"audioseal {VERSION} not found at {FOLDER}: pip install --no-deps --target {FOLDER} "
                    f"audioseal=={VERSION} omegaconf==2.3.0 antlr4-python3-runtime==4.9.3")
    os.environ.setdefault("NO_TORCH_COMPILE", "1")
    if str(FOLDER) not in sys.path:
        sys.path.insert(0, str(FOLDER))
    module = importlib.import_module("audioseal")
    assert module.__version__ == VERSION, module.__version__
    return module


def seanet(**overrides) -> dict:
    """A tiny causal SEANet config in the cards' layout (hop 8 samples)."""
    cfg = {
        "activation": "ELU", "activation_params": {"alpha": 1.0}, "causal": True, "channels": 1,
        "compress": 2, "dilation_base": 2, "dimension": 8, "disable_norm_outer_blocks": 0,
        "kernel_size": 7, "last_kernel_size": 7, "lstm": 2, "n_filters": 4, "n_residual_layers": 1,
        "norm": "weight_norm", "norm_params": {}, "pad_mode": "constant", "ratios": [4, 2],
        "residual_kernel_size": 3, "true_skip": True,
    }
    return {**cfg, **overrides}


def generator_cfg(**overrides) -> dict:
    return {"nbits": 16, "seanet": seanet(**overrides),
            "decoder": {"final_activation": None, "final_activation_params": None, "trim_right_ratio": 1.0}}


def detector_cfg(**overrides) -> dict:
    return {"nbits": 16, "seanet": seanet(**overrides), "detector": {"output_dim": 32}}


def released_state(model) -> dict:
    """The reference model's weights as the released checkpoints hold them: pre-0.2 names
    (no ``inner_conv``) and every convolution weight-normed as a ``weight_g``/``weight_v`` pair."""
    import torch

    out = {}
    for name, tensor in model.state_dict().items():
        name = name.replace(".inner_conv.", ".")
        is_conv = (".conv.conv." in name or ".convtr.convtr." in name) and name.endswith(".weight")
        if is_conv:
            g = tensor.flatten(1).norm(dim=1).view(-1, *([1] * (tensor.dim() - 1)))
            # a v off by a per-row scale, so a loader that ignores g or the norm fails
            scale = torch.linspace(0.5, 2.0, tensor.shape[0]).view_as(g)
            out[name[: -len("weight")] + "weight_g"] = g.clone()
            out[name[: -len("weight")] + "weight_v"] = (tensor * scale).clone()
        else:
            out[name] = tensor.clone()
    return out


_TOPS = {"encoder": "encoder.model.", "decoder": "decoder.model.", "message_table": "msg_processor.msg_processor.",
         "upsample": "detector.0.reverse_convolution.", "head": "detector.1."}


def released_from_ours(model) -> dict:
    """Our port's weights under the released names (plain weights, no weight norm): the inverse
    of ``released_name``, found from each parameter's module."""
    from torch import nn

    out = {}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        top = _TOPS[parts[0]]
        if parts[0] == "encoder" and hasattr(model, "head"):
            top = "detector.0.model."
        owner = model.get_submodule(".".join(parts[:-1]))
        inner = ""
        if len(parts) > 2 and isinstance(owner, nn.Conv1d):
            inner = ".conv.conv"
        elif len(parts) > 2 and isinstance(owner, nn.ConvTranspose1d):
            inner = ".convtr.convtr"
        middle = ".".join(parts[1:-1])
        out[(top + middle + inner + "." + parts[-1]).replace("..", ".")] = tensor.clone()
    return out
