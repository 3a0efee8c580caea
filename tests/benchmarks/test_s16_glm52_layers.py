"""S16 (GLM-5.2's layers and Command A+'s MoE): the ``--smoke`` path on the CPU, ours and transformers' modules on
the same weights agreeing on every row, every row with a floor."""

from __future__ import annotations

import json

from benchmarks import s16_glm52_layers as s16


def test_smoke_rows_agree_with_transformers(tmp_path):
    assert s16.main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s16.NAME}-*.json")
    data = json.loads(path.read_text())
    assert not data["errors"]
    rows = {m["metric"]: m for m in data["metrics"]}
    assert set(rows) == {"moe_decode@1", "moe_decode@64", "moe_prefill@48", "mla_dsa_decode@1x40",
                         "mla_dsa_decode@64x40", "mla_dsa_prefill@1x48", "cmda_moe_decode@1", "cmda_moe_decode@64",
                         "cmda_moe_prefill@48"}
    for name, row in rows.items():
        assert row["notes"]["rel_err"] <= 1e-5, name
        assert row["ours"] > 0 and row["baseline"] > 0 and row["floor"] > 0, name


def test_command_a_plus_moe_part_alone(tmp_path):
    """``--parts cmda_moe``: Command A+'s MoE rows only, transformers' block on the same weights
    (the smoke config routes 3 of 8 experts, so a 64-token step touches several)."""
    assert s16.main(["--smoke", "--parts", "cmda_moe", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s16.NAME}-*.json")
    rows = {m["metric"]: m for m in json.loads(path.read_text())["metrics"]}
    assert set(rows) == {"cmda_moe_decode@1", "cmda_moe_decode@64", "cmda_moe_prefill@48"}
    assert rows["cmda_moe_decode@1"]["notes"]["experts_touched"] == 3
    assert rows["cmda_moe_decode@64"]["notes"]["experts_touched"] > 3
    assert all(row["notes"]["rel_err"] <= 1e-5 for row in rows.values())
