"""The benchmark scenarios' ``--smoke`` paths (tiny models on the CPU, the same code as on the
GPU): each run writes a record whose table has ours, the floor and, where a baseline exists,
the baseline. Plus the S2 FLOP count against torch's FLOP counter."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import s2_flux2_klein as s2
from benchmarks import s3_orpheus as s3
from benchmarks import s4_whisper as s4


def record(out_dir, name):
    [path] = out_dir.glob(f"{name}-*.json")
    data = json.loads(path.read_text())
    assert data["hardware"]["torch"] and data["date"] and not data["errors"]
    return data, {m["metric"]: m for m in data["metrics"]}


@pytest.mark.slow  # runs the benchmark script end to end
def test_s2_flux2_klein_smoke(tmp_path):
    assert s2.main(["--smoke", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s2.NAME)
    assert set(rows) == {f"dit_step@{n} {k}" for n in (1, 4) for k in ("eager", "compiled")} | {"image@1", "image@4"}
    for name, row in rows.items():
        assert row["ours"] > 0 and row["floor"] > 0 and 0 < row["ours/floor"]
        assert (row["baseline"] is None) == name.startswith("image")
    assert data["dit"]["ours_vs_baseline_rel_err"] < 1e-5  # same weights, same function as diffusers


def test_s2_flop_count_matches_torch_counter():
    from mstar.model.flux2 import Flux2Transformer, Flux2TransformerConfig

    cfg, rows_cols, text = s2.TINY_DIT, (6, 5), 7
    n_img = rows_cols[0] * rows_cols[1]
    with torch.device("meta"):
        model = Flux2Transformer(Flux2TransformerConfig.from_dict(cfg))
        inputs = (torch.empty(2, n_img, cfg["in_channels"]), torch.empty(2, text, cfg["joint_attention_dim"]),
                  torch.empty(2), torch.zeros(n_img, 4, dtype=torch.int64), torch.zeros(text, 4, dtype=torch.int64))
        with FlopCounterMode(display=False) as counter:
            model(*inputs)
    counted, ours = counter.get_total_flops(), s2.dit_step_flops(cfg, n_img, text, 2)
    # What the formula leaves out (timestep embedding, modulation) is small beside the rest.
    assert ours <= counted <= 1.1 * ours, (ours, counted)


@pytest.mark.slow  # runs the benchmark script end to end
def test_s3_orpheus_smoke(tmp_path):
    assert s3.main(["--smoke", "--streams", "2", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s3.NAME)
    assert set(rows) == {"ttfa@2", "rtf@2"}
    assert rows["rtf@2"]["ours"] > 0 and rows["ttfa@2"]["ours"] > 0
    assert all(row["floor"] > 0 and row["baseline"] is None for row in rows.values())
    assert data["ours"]["2"]["audio_s_per_stream"] == pytest.approx(4 * 2048 / 24000)


@pytest.mark.slow  # runs the benchmark script end to end
def test_s4_whisper_smoke(tmp_path):
    assert s4.main(["--smoke", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s4.NAME)
    assert set(rows) == {"rtf@1", "rtf@4"}
    for row in rows.values():
        assert row["ours"] > 0 and row["baseline"] > 0 and row["floor"] > 0
        assert row["notes"]["floor_with_cross_kv_reads"] <= row["floor"]


@pytest.mark.slow  # runs the benchmark script end to end, with a server process
def test_s1_http_smoke(tmp_path):
    from benchmarks import s1_llama_decode as s1

    assert s1.main(["--smoke", "--http", "--skip-baseline", "--latency-runs", "1", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s1.NAME)
    assert set(rows) == {"latency@1", "throughput@4", "latency@1 http", "ttft@1 http", "throughput@4 http",
                         "ttft@4 http"}
    for n, name in ((1, "latency@1 http"), (4, "throughput@4 http")):
        http, inproc = data["http"][str(n)], data["ours"][str(n)]
        assert http["tokens"] == inproc["tokens"] == n * 16  # every stream made all its tokens, both ways
        row = rows[name]
        assert row["ours"] > 0 and row["baseline"] > 0 and row["floor"] > 0
        assert row["ours/baseline"] == pytest.approx(row["ours"] / row["baseline"])
        assert rows[f"ttft@{n} http"]["ours"] == pytest.approx(http["first_token_ms_median"])
