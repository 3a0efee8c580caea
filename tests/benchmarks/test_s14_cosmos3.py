"""S14 (Cosmos3): the ``--smoke`` path end to end on the CPU: the DiT step against diffusers'
tower with the same weights (eager), a whole tiny clip through the deployment and the pipeline,
the DROID policy's chunks per second (the pipeline's policy call at 1); a part that fails is
recorded and the others still run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")
from benchmarks import s14_cosmos3 as s14  # noqa: E402
from tests.support.records import FLOOR_SLACK


def record(tmp_path):
    [path] = tmp_path.glob(f"{s14.NAME}-*.json")
    return json.loads(path.read_text())


def test_smoke_runs_every_part(tmp_path):
    assert s14.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = record(tmp_path)
    assert not data["errors"]
    rows = {m["metric"]: m for m in data["metrics"]}
    assert set(rows) == {"dit_step@1 eager", "dit_step@2 eager", "clip t2v", "chunks/s@1", "actions/s@1",
                         "chunks/s@2", "actions/s@2"}
    for name, row in rows.items():
        assert row["ours"] > 0 and row["floor"] > 0 and 0 < row["ours/floor"] < FLOOR_SLACK, name
    for name in ("dit_step@1 eager", "dit_step@2 eager", "clip t2v", "chunks/s@1", "actions/s@1"):
        assert rows[name]["baseline"] > 0 and "baseline_error" not in rows[name]["notes"], name
    assert rows["dit_step@1 eager"]["notes"]["rel_err_row0"] < 1e-5  # the same weights: the same velocity
    assert rows["actions/s@2"]["ours"] == pytest.approx(4 * rows["chunks/s@2"]["ours"])


def test_a_failing_part_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no tower")

    monkeypatch.setattr(s14, "dit_rows", broken)
    assert s14.main(["--smoke", "--parts", "dit_step,policy", "--batches", "1", "--out", str(tmp_path)]) == 1
    data = record(tmp_path)
    assert data["errors"] == {"dit_step": "RuntimeError: no tower"}
    assert {m["metric"] for m in data["metrics"]} == {"chunks/s@1", "actions/s@1"}
