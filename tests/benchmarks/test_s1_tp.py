"""S1's ``--tp-sizes`` path on the CPU (``--smoke``: tiny model, TP over gloo): one deployment
with worker processes per TP size, a table row per size and stream count, and a row whose
ours/baseline is the TP=2 throughput over TP=1's."""

import json

import pytest

from benchmarks import s1_llama_decode as s1


@pytest.mark.slow  # runs the benchmark script end to end
def test_s1_smoke_records_tp2_against_tp1(tmp_path):
    assert s1.main(["--smoke", "--tp-sizes", "2,1", "--skip-baseline", "--latency-runs", "1",
                    "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s1.NAME}-*.json")
    data = json.loads(path.read_text())
    assert not data["errors"] and data["settings"]["tp_sizes"] == [1, 2]
    rows = {m["metric"]: m for m in data["metrics"]}
    assert set(rows) == {"latency@1 tp=1", "throughput@4 tp=1", "latency@1 tp=2", "throughput@4 tp=2",
                         "tp=2 vs tp=1 throughput@4"}
    assert set(data["ours"]) == {"tp=1", "tp=2"}
    for tp in (1, 2):
        assert rows[f"throughput@4 tp={tp}"]["ours"] == data["ours"][f"tp={tp}"]["4"]["throughput_tok_s"] > 0
        assert data["ours"][f"tp={tp}"]["4"]["tokens"] == 4 * 16  # every stream made all its tokens
    # the floor of TP=2 is that of two devices
    assert rows["throughput@4 tp=2"]["floor"] == pytest.approx(2 * rows["throughput@4 tp=1"]["floor"])
    ratio = rows["tp=2 vs tp=1 throughput@4"]
    assert ratio["ours"] == rows["throughput@4 tp=2"]["ours"] and ratio["baseline"] == rows["throughput@4 tp=1"]["ours"]
    assert ratio["ours/baseline"] == pytest.approx(ratio["ours"] / ratio["baseline"])


@pytest.mark.parametrize("text", ["0,1", "1,two"])
def test_s1_refuses_tp_sizes_that_are_not_sizes(text):
    with pytest.raises(SystemExit, match="--tp-sizes"):
        s1.parse_tp_sizes(text)
