"""S10 (BAGEL-7B-MoT image generation and chat against bagel2): the ``--smoke`` path end to end
on the CPU, the reference holding exactly ours' dummy weights, and the floor's weight counts
against our language model built at the released shapes on the meta device."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("bagel2")
from benchmarks import s10_bagel as s10  # noqa: E402
from tests.support.records import FLOOR_SLACK

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def test_smoke_runs_every_row(tmp_path):
    assert s10.main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s10.NAME}-*.json")
    data = json.loads(path.read_text())
    assert not data["errors"]
    rows = {m["metric"]: m for m in data["metrics"]}
    assert set(rows) == {"image@1", "images@4", "chat time to first token", "chat ms per output token"}
    for name, row in rows.items():
        assert row["ours"] > 0 and row["baseline"] > 0, name
        assert row["notes"]["baseline_attention"] == data["baseline"]["attention"]
    for name in ("image@1", "images@4", "chat ms per output token"):
        assert 0 < rows[name]["ours/floor"] < FLOOR_SLACK, name
    assert "stand-in" in data["baseline"]["attention"] or "flash_attn" in data["baseline"]["attention"]
    assert len(data["ours"]["s_per_4_images"]) == len(data["baseline"]["s_per_4_images"]) == 1


def test_reference_holds_ours_weights(tmp_path):
    """Ours' dummy weights, drawn again, land in bagel2's ``Bagel`` and ``AutoEncoder`` unchanged."""
    from mstar.model.bagel.vae import original_name
    from tests.support import bagel_reference as br

    settings = s10.settings_from(s10.parse_args(["--smoke"]))
    directory = s10.model_dir(tmp_path / "model", settings)
    model, ae = s10.build_reference(settings, directory, br)
    ours = s10.ours_released_state(settings, directory, torch.device("cpu"))
    theirs = model.state_dict()
    assert len(ours["model"]) > 50
    for name, tensor in ours["model"].items():
        assert torch.equal(theirs[name], tensor), name
    for name, tensor in ae.state_dict().items():
        assert torch.equal(tensor, ours["vae"][original_name(name, ours["vae_levels"])].reshape(tensor.shape)), name
    # the draw is seeded (as the deployment's, which uses the same seeds): a second one is the same
    again = s10.ours_released_state(settings, directory, torch.device("cpu"))
    assert all(torch.equal(again["model"][k], v) for k, v in ours["model"].items())


def test_floor_counts_the_released_language_model():
    """The generation weights a denoise step reads are the MoT's ``*_moe_gen`` matrices; a decode
    step reads the understanding matrices and the LM head (the embedding is a lookup)."""
    from mstar.model.bagel.config import BagelLLMConfig
    from mstar.model.bagel.llm import BagelLanguageModel

    with torch.device("meta"):
        model = BagelLanguageModel(BagelLLMConfig.from_hf_dict(s10.LLM_7B))
    matrices = {n: p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed_tokens" not in n}
    gen = sum(v for n, v in matrices.items() if "moe_gen" in n)
    und = sum(v for n, v in matrices.items() if "moe_gen" not in n)
    assert s10.generation_weights(s10.LLM_7B) == gen
    assert s10.understanding_weights(s10.LLM_7B) == und
    assert 14.0e9 < sum(p.numel() for p in model.parameters()) < 14.3e9  # BAGEL-7B-MoT's 14B parameters


def test_floor_arithmetic():
    """One denoise step's FLOPs: 2 per multiply-add of every generation matrix and of attention."""
    llm = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1)
    per_layer = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16
    assert s10.generation_weights(llm) == 2 * per_layer
    q = 10 + 2
    want = 2 * q * 2 * per_layer + 2 * 2 * q * (30 + q) * 8 * 2
    assert s10.step_flops(llm, 10, 30, 1) == want
    assert s10.step_flops(llm, 10, 30, 3) == 3 * want
