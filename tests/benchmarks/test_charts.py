"""benchmarks/charts.py draws one PNG per scenario from JSON records (the newest record of
each name), with rates for times per token or image, and skips what is not a record."""

import json

import pytest

pytest.importorskip("matplotlib")

from benchmarks import charts  # noqa: E402
from benchmarks.common import Metric, write_record  # noqa: E402


def _records(directory):
    s1 = "S1 llama-3.1-8B decode"
    write_record("s1_llama_decode", {"scenario": s1, "hardware": {"gpu": None, "cpu": "test"}, "metrics": [
        Metric(s1, "latency@1", "ms/token", "lower", ours=5.0, baseline=8.0, floor=4.0),
        Metric(s1, "throughput@16", "tok/s", "higher", ours=2800, baseline=1600, floor=4000),
        Metric(s1, "throughput@16 prompt=8192", "tok/s", "higher", ours=390, baseline=None, floor=540),
    ]}, directory)
    s5 = "S5 llama-3.1-8B shared prefix"
    write_record("s5_shared_prefix", {"scenario": s5, "hardware": {}, "metrics": [
        Metric(s5, "ttft_p50@64", "ms", "lower", ours=100, baseline=600, floor=40),
        Metric(s5, "throughput@64", "tok/s", "higher", ours=8000, baseline=4000, floor=14000),
    ]}, directory)
    (directory / "notes.json").write_text(json.dumps({"not": "a record"}))


def test_charts_one_png_per_scenario(tmp_path, capsys):
    _records(tmp_path / "records")
    assert charts.main([str(tmp_path / "records"), "--out", str(tmp_path / "img")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "img").glob("*.png"))
    assert pngs == ["s1_llama_decode.png", "s5_shared_prefix.png"]
    for png in (tmp_path / "img").glob("*.png"):
        assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size < 200_000


def test_charts_panels_turn_times_into_rates(tmp_path):
    _records(tmp_path)
    records = charts.load([str(tmp_path)])
    assert set(records) == {"s1_llama_decode", "s5_shared_prefix"}
    s1 = charts.panels(records["s1_llama_decode"])
    points = s1[("throughput", "tok/s", True)]  # latency@1 joins throughput as one stream's tok/s
    assert [p.n for p in points] == [1, 16]
    assert points[0].ours == pytest.approx(200.0) and points[0].floor == pytest.approx(250.0)
    assert s1[("throughput prompt=8192", "tok/s", True)][0].baseline is None
    s5 = charts.panels(records["s5_shared_prefix"])
    assert s5[("ttft_p50", "ms", False)][0].baseline == 600  # a time that is not per item stays a time


def test_charts_newest_record_wins(tmp_path):
    for date, ours in (("2026-12-01T00:00:00+00:00", 1.0), ("2026-12-02T00:00:00+00:00", 2.0)):
        record = {"name": "s4_whisper", "date": date, "scenario": "S4", "metrics": [
            Metric("S4", "rtf@1", "x", "higher", ours=ours, floor=10.0).as_dict()]}
        (tmp_path / f"s4_whisper-{date[:10]}.json").write_text(json.dumps(record))
    assert charts.load([str(tmp_path)])["s4_whisper"]["metrics"][0]["ours"] == 2.0
