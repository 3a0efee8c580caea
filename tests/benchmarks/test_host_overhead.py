"""benchmarks/host_overhead.py ``--model orpheus``, tiny: S3's speech streams through the
runtime, the host work of their decode phase measured and profiled."""

import json

from benchmarks import host_overhead


def test_orpheus_host_overhead_runs(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert host_overhead.main(["--model", "orpheus", "--streams", "1,2", "--new-tokens", "28", "--repeats", "1",
                               "--profile", "--top", "5", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["model"] == "orpheus" and set(record["results"]) == {"1", "2"}
    for row in record["results"].values():
        assert row["steps"] >= 20 and row["host_cpu_ms_per_step"] > 0 and row["sampling_ms_per_step"] > 0
        assert row["model_ms_per_step"] > 0 and row["wall_ms_per_step"] > row["host_ms_per_step"]
    assert "function calls" in capsys.readouterr().out  # the profile's list
