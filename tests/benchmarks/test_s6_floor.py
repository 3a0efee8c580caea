"""S6's floor: the encoder's FLOPs as the formula counts them against torch's FLOP counter on
the meta device at parakeet-tdt-0.6b-v3's real shapes, the bound's parts on H200 datasheet
rates, and the transcript comparison."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import s6_parakeet as s6
from mstar.model.fastconformer.config import TransducerConfig
from mstar.model.fastconformer.transducer import TransducerModel


def test_s6_encoder_flops_match_torch_counter():
    config = TransducerConfig.from_hf_dict(dict(s6.PARAKEET_TDT_V3, model_type="parakeet_tdt"))
    roof = s6.Roofline.of(s6.PARAKEET_TDT_V3, torch.bfloat16, s6.H200_BF16_TFLOPS, s6.H200_GBS, 3000)
    assert roof.frames == config.encoder.frames(3000) == 375
    with torch.device("meta"):
        model = TransducerModel(config)
        params = sum(p.numel() for p in model.encoder.parameters()) + model.encoder_projector.weight.numel()
        with FlopCounterMode(display=False) as counter:
            model.encode(torch.empty(1, 3000, 128))
    counted, ours = counter.get_total_flops(), roof.clip_flops + roof.batch_flops
    # what the formula leaves out (norms, activations, the depthwise convs' bias adds) is small
    assert 0.97 * counted <= ours <= 1.03 * counted, (ours, counted)
    assert roof.encoder_bytes == pytest.approx(2 * params, rel=0.01)  # bf16 encoder weights, ~1.2 GB
    assert roof.clip_flops == pytest.approx(0.47e12, rel=0.03)  # ~2 x 0.6 B parameters x 375 frames


def test_s6_floor_on_datasheet_rates():
    """32 clips of 30 s: the encoder's FLOPs (~15 ms at 989 TFLOP/s) dominate; one clip: ~0.5 ms
    of encoder and each greedy step's weight read (~12 M parameters, 5 us at 4.8 TB/s)."""
    roof = s6.Roofline.of(s6.PARAKEET_TDT_V3, torch.bfloat16, s6.H200_BF16_TFLOPS, s6.H200_GBS, 3000)
    assert roof.encoder_seconds(32) == pytest.approx(32 * 0.475e-3, rel=0.03)
    assert roof.step_seconds(1) == pytest.approx(2 * 12.2e6 / 4.8e12, rel=0.02)
    steps = s6.least_steps([120, 90, 140], roof.frames, 4)
    assert steps == 140 and s6.least_steps([10], roof.frames, 4) == 94  # the cursor moves 4 frames at most
    assert roof.batch_seconds(32, steps) == pytest.approx(roof.encoder_seconds(32) + 140 * roof.step_seconds(32))


def test_s6_agreement_counts_edits():
    assert s6.edit_distance([1, 2, 3], [1, 3]) == 1 and s6.edit_distance([], [4, 5]) == 2
    got = s6.agreement([[1, 2, 3], [7, 8]], [[1, 2, 3], [7, 9, 8]])
    assert got["clips_identical"] == 1 and got["token_edits"] == 1 and got["token_error_rate"] == pytest.approx(1 / 6)
