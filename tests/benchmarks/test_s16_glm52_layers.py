"""S16 (GLM-5.2's layers): the ``--smoke`` path on the CPU, ours and transformers' modules on
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
                         "mla_dsa_decode@64x40", "mla_dsa_prefill@1x48"}
    for name, row in rows.items():
        assert row["notes"]["rel_err"] <= 1e-5, name
        assert row["ours"] > 0 and row["baseline"] > 0 and row["floor"] > 0, name
