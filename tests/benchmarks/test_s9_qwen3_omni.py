"""S9 (Qwen3-Omni MoE layer and thinker decode): the ``--smoke`` path end to end on the CPU, and
the floor's weight count against both models built at the released shapes on the meta device."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_omni_moe")
from benchmarks import s9_qwen3_omni as s9  # noqa: E402


def test_smoke_runs_every_part(tmp_path):
    assert s9.main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s9.NAME}-*.json")
    data = json.loads(path.read_text())
    assert not data["errors"]
    rows = {m["metric"]: m for m in data["metrics"]}
    kernels = ["loop", "grouped_mm"]
    if importlib.util.find_spec("mstar.layers.triton_moe") is None:
        assert "triton" in data["moe"]["skipped"]  # the column is left out with a note, not failed
    moe = {f"moe@{t} {k}" for t in (1, 8, 32) for k in kernels}
    decode = {f"{m} {k}" for m in ("latency@1", "throughput@2") for k in kernels}
    assert moe | decode <= set(rows)
    for name in moe | decode:
        row = rows[name]
        assert row["ours"] > 0 and row["baseline"] > 0 and row["floor"] > 0 and 0 < row["ours/floor"], name
    for t in ("1", "8", "32"):  # same weights as transformers' block: float32 agrees closely
        errors = data["moe"]["by_tokens"][t]["ours_rel_err"]
        assert set(kernels) <= set(errors) and max(errors.values()) < 1e-5
        assert 1 <= data["moe"]["by_tokens"][t]["distinct_experts"] <= 8
    assert data["decode"]["baseline"]["experts_implementation"]


def test_floor_counts_the_released_thinker():
    """The roofline's weights (dense parts, every expert, the embedding) are the parameters of
    ours and of transformers' thinker text model built from the benchmark's config."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig
    from mstar.model.qwen3_omni.modeling import Qwen3OmniThinkerForCausalLM

    settings = dataclasses.replace(s9.settings_from(s9.parse_args(["--smoke"])), text=dict(s9.THINKER_TEXT))
    config = s9.thinker_config(settings)
    with s9.built_on("meta", torch.bfloat16):
        ours = Qwen3OmniThinkerForCausalLM(Qwen3OmniTextConfig.from_hf_dict(config))
        theirs = Qwen3OmniMoeThinkerForConditionalGeneration(Qwen3OmniMoeThinkerConfig(**config))
    ours_count = sum(p.numel() for p in ours.parameters())
    theirs_count = sum(p.numel() for n, p in theirs.named_parameters() if "audio_tower" not in n and "visual" not in n)
    text = s9.THINKER_TEXT
    roof = s9.ThinkerRoofline(text, 2, 1000.0, 100.0)
    expert = 3 * text["hidden_size"] * text["moe_intermediate_size"]
    every_expert = text["num_hidden_layers"] * text["num_experts"] * expert
    embedding = text["vocab_size"] * text["hidden_size"]
    assert roof.experts_hit(10**6) == pytest.approx(text["num_experts"])
    assert (roof.weight_bytes(10**6) - 10**6 * text["hidden_size"] * 2) / 2 == pytest.approx(ours_count - embedding)
    assert ours_count == theirs_count == roof._dense_params + every_expert + embedding
    assert 30.4e9 < ours_count < 30.6e9  # Qwen3-Omni-30B-A3B's thinker text model
