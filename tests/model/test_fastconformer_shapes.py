"""At the released models' sizes (transformers' default configs, which are theirs), our
modules have exactly the reference's parameters and shapes: built on the meta device, no
weights, so a real-size layout mistake (the subsampled mel bins, GQA heads, the duration
outputs) is caught without a download."""

from __future__ import annotations

import pytest
import torch
from transformers import CanaryConfig as HFCanaryConfig
from transformers import CanaryForConditionalGeneration as HFCanary
from transformers import (
    Nemotron3_5AsrConfig,
    Nemotron3_5AsrForRNNT,
    ParakeetForTDT,
    ParakeetTDTConfig,
)

from mstar.model.canary.config import CanaryConfig
from mstar.model.canary.modeling import CanaryForConditionalGeneration
from mstar.model.fastconformer.config import TransducerConfig
from mstar.model.fastconformer.transducer import TransducerModel


def shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    persistent = {}
    for prefix, sub in module.named_modules():
        for name, tensor in list(sub.named_parameters(recurse=False)) + [
                (n, b) for n, b in sub.named_buffers(recurse=False) if n not in sub._non_persistent_buffers_set]:
            persistent[f"{prefix}.{name}" if prefix else name] = tuple(tensor.shape)
    return persistent


@pytest.mark.parametrize("key", ["parakeet", "nemotron_asr", "canary"])
def test_released_sizes_have_the_reference_parameters(key: str) -> None:
    with torch.device("meta"):
        if key == "parakeet":  # parakeet-tdt-0.6b-v3: 128 mel bins, 8192 tokens and the blank
            hf_config = ParakeetTDTConfig(encoder_config={"num_mel_bins": 128})
            ref, ours = ParakeetForTDT(hf_config), TransducerModel(TransducerConfig.from_hf_dict(hf_config.to_dict()))
        elif key == "nemotron_asr":
            hf_config = Nemotron3_5AsrConfig()
            ref = Nemotron3_5AsrForRNNT(hf_config)
            ours = TransducerModel(TransducerConfig.from_hf_dict(hf_config.to_dict()))
        else:
            hf_config = HFCanaryConfig()
            ref = HFCanary(hf_config)
            ours = CanaryForConditionalGeneration(CanaryConfig.from_hf_dict(hf_config.to_dict()))
    want, got = shapes(ref), shapes(ours)
    assert got == want
    assert sum(torch.Size(s).numel() for s in got.values()) > 5e8  # a real size, not a toy
