"""Orpheus's SNAC codec loads from the layout of hubertsiuzdak/snac_24khz (config.json and a
pytorch_model.bin state dict) and decodes like the snac package."""

import json

import pytest
import torch

from mstar.config import parse_config
from mstar.model.orpheus.model import Orpheus

snac = pytest.importorskip("snac")

SMALL = {"sampling_rate": 24000, "encoder_dim": 8, "encoder_rates": [2, 4, 8, 8], "decoder_dim": 32,
         "decoder_rates": [8, 8, 4, 2], "attn_window_size": None, "codebook_size": 64, "codebook_dim": 8,
         "vq_strides": [4, 2, 1], "noise": True, "depthwise": True}


def test_snac_checkpoint_layout_loads_and_decodes_like_the_package(tmp_path):
    torch.manual_seed(0)
    reference = snac.SNAC(**SMALL).eval()
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    spec = Orpheus(parse_config({"model": "orpheus", "model_kwargs": {"snac_path": str(tmp_path)}}))
    decoder = spec.checkpoint().snac(torch.device("cpu"))
    codes = [torch.randint(0, 64, (1, 3 * s)) for s in (1, 2, 4)]
    with torch.inference_mode():
        torch.manual_seed(5)
        want = reference.decode(codes)
        torch.manual_seed(5)
        got = decoder.decode(codes)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
