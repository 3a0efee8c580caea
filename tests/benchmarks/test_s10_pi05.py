"""S10 (Pi0.5 action chunks): the ``--smoke`` path end to end on the CPU (ours eager and
compiled, transformers' baseline with ours' weights), and the floor's parameter counts against
both policies built at the released shapes on the meta device."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers.models.pi05")
from benchmarks import s10_pi05 as s10  # noqa: E402
from tests.support.records import FLOOR_SLACK


def test_smoke_runs_ours_and_the_baseline(tmp_path):
    assert s10.main(["--smoke", "--compile", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s10.NAME}-*.json")
    data = json.loads(path.read_text())
    assert not data["errors"]
    rows = {m["metric"]: m for m in data["metrics"]}
    names = {f"{m} {v}" for m in ("latency@1", "chunks/s@4", "actions/s@4") for v in ("eager", "compile")}
    names |= {f"chunks/s@4 {v}, inputs prepared" for v in ("eager", "compile")}
    assert names == set(rows)
    for name in names:
        row = rows[name]
        assert row["ours"] > 0 and row["baseline"] > 0 and row["floor"] > 0, name
        assert 0 < row["ours/floor"] < FLOOR_SLACK, name
    chunk = s10.TINY["chunk_size"]
    for v in ("eager", "compile"):
        assert rows[f"actions/s@4 {v}"]["ours"] == pytest.approx(chunk * rows[f"chunks/s@4 {v}"]["ours"])
        assert rows[f"chunks/s@4 {v}, inputs prepared"]["ours"] > rows[f"chunks/s@4 {v}"]["ours"]  # less time
    baseline = data["baseline"]
    assert baseline["rel_err_vs_ours_eager"] < 1e-5  # the same weights copied in: the same chunk
    assert data["ours"]["eager"]["prompt_len"] == rows["latency@1 eager"]["notes"]["prompt_tokens"] > 6


def test_baseline_missing_is_a_clean_skip(tmp_path, monkeypatch):
    """As on a transformers without ``pi05`` (5.17): the modules cannot be imported."""
    import sys

    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    for name in ("PI05Config", "PI05ForConditionalGeneration"):
        monkeypatch.delattr(transformers, name, raising=False)
    for module in ("transformers.models.pi05", "transformers.models.pi05.configuration_pi05",
                   "transformers.models.pi05.modeling_pi05"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(s10.BaselineUnavailable):
        s10.reference_classes()
    assert s10.main(["--smoke", "--runs", "1", "--batches", "1", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s10.NAME}-*.json")
    data = json.loads(path.read_text())
    assert not data["errors"] and "5.17" in data["baseline"]["unavailable"]
    [row] = data["metrics"]
    assert row["ours"] > 0 and row["baseline"] is None


def test_floor_counts_the_released_policy():
    """The roofline's parts add up to ours' and transformers' parameters at pi05_base's shapes
    (3.35 B: PaliGemma 2B with SigLIP so400m and the 300M expert), and its phases scale: the
    prefix with the observations, a step's weights read once per batch."""
    from transformers import PI05ForConditionalGeneration

    settings = dataclasses.replace(s10.settings_from(s10.parse_args(["--smoke"])), lerobot=dict(s10.RELEASED))
    roof = s10.Pi05Roofline.build(s10.lerobot_config(settings), 2, 1000.0, 100.0)
    with torch.device("meta"):
        theirs = PI05ForConditionalGeneration(s10.reference_config(roof.config))
    assert roof.total_params == sum(p.numel() for p in theirs.parameters())
    assert 3.3e9 < roof.total_params < 3.4e9
    assert roof.config.tokens_per_image == 256 and roof.config.chunk_size == 50
    one, sixteen = roof.chunk_s(1, 3, 50, 10), roof.chunk_s(16, 3, 50, 10)
    weights = (roof.vision_params + roof.language_params + 10 * roof.expert_params) * 2
    assert weights < one["bytes"] < 1.02 * weights  # batch 1: the weights, and a little KV
    assert sixteen["flops"] == pytest.approx(16 * one["flops"])
    assert one["floor_s"] == pytest.approx(one["prefix_s"] + 10 * one["step_s"])


def test_ours_prepares_every_observation_before_submitting_any(tmp_path):
    """The N observations of a batch go through the front end first and are then submitted
    together: submitted as each was prepared, the first ran its prefill alone while the others
    were still being decoded, and 16 trickled through 14 prefills (S10's docstring)."""
    settings = dataclasses.replace(s10.settings_from(s10.parse_args(["--smoke", "--batches", "4"])), runs=1)
    ours = s10.Ours(settings, s10.write_policy_dir(settings, tmp_path / "policy"), {})
    calls = []
    spec, runtime = ours.deployment.spec, ours.deployment.runtime
    prepare, submit = spec.prepare_generate, runtime.submit
    spec.prepare_generate = lambda s: calls.append("prepare") or prepare(s)
    runtime.submit = lambda *a, **k: calls.append("submit") or submit(*a, **k)
    try:
        result = ours.run(4)
    finally:
        ours.close()
    assert calls == ["prepare"] * 4 + ["submit"] * 4
    assert 0 < result["front_s"] < result["wall_s"]
    assert all(result["front_s"] < t <= result["wall_s"] for t in result["latency_s"])  # from the first front end


def test_front_end_sweep_smoke(tmp_path):
    """benchmarks/s10_pi05_front.py --smoke: every part of the thread sweep is timed and recorded."""
    from benchmarks import s10_pi05_front

    assert s10_pi05_front.main(["--smoke", "--observations", "4", "--threads", "1,2", "--runs", "1",
                                "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("s10_pi05_front-*.json")
    results = json.loads(path.read_text())["results"]
    for part in ("prepare", "prepare_closed", "decode"):
        assert set(results[part]) == {"1", "2"} and all(ms > 0 for ms in results[part].values())
    assert set(results["switch"]) == {"2"}
