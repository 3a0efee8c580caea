"""S1's floor counts the whole workload (issue 17): the prefill's FLOPs, the weights and the
KV reads of every decode step; and the long-context row that this floor is for."""

import json

import pytest
import torch

from benchmarks import s1_llama_decode as s1
from benchmarks.common import LLAMA_3_1_8B


def test_s1_floor_counts_prefill_and_kv_reads():
    """On H200-like rates (4124 GB/s, 761 TFLOP/s): 64 streams of 128 + 128 tokens about
    12,150 tok/s (the weights-only column said ~17,600); 16 streams of 8,192-token prompts about
    500 (weights-only: ~4,400)."""
    roof = s1.Roofline.of(LLAMA_3_1_8B, torch.bfloat16, 4124.0, 761.0)
    assert roof.weight_bytes_read == pytest.approx(15.0e9, rel=0.01)
    assert roof.throughput_floor(64, 128, 128) == pytest.approx(12_150, rel=0.03)
    assert 64 / roof.step_seconds(64) == pytest.approx(17_600, rel=0.01)
    assert roof.throughput_floor(16, 8192, 128) == pytest.approx(540, rel=0.05)
    # the prefill of 16 x 8192 tokens alone is ~2.8 s at this rate (attention ~0.37 s of it)
    assert roof.prefill_seconds([(8192, 0)] * 16) == pytest.approx(2.77, rel=0.03)
    # a prefix shared by every sequence and read once per step makes a decode step cheaper
    assert roof.step_seconds(64, 1088, shared=1024) < roof.step_seconds(64, 1088)
    # a cached prefix leaves only the new tokens' FLOPs (and their attention to it)
    assert roof.prefill_seconds([(64, 1024)] * 64) < roof.prefill_seconds([(1088, 0)] * 64) / 5


@pytest.mark.slow  # runs the benchmark script end to end
def test_s1_smoke_long_context_row(tmp_path):
    assert s1.main(["--smoke", "--streams", "1", "--long-context", "--latency-runs", "1", "--baseline-runs", "1",
                    "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s1.NAME}-*.json")
    data = json.loads(path.read_text())
    assert not data["errors"] and data["settings"]["long_context"] == {"streams": 2, "prompt_len": 256}
    rows = {m["metric"]: m for m in data["metrics"]}
    assert set(rows) == {"latency@1", "throughput@2 prompt=256"}
    long = rows["throughput@2 prompt=256"]
    assert long["ours"] > 0 and long["baseline"] > 0 and long["notes"]["ours_prompt_len"] == 256
    # the floor counts the prefill and the KV reads: below the weights-only decode rate
    assert 0 < long["floor"] < long["notes"]["floor_tok_s_weights_only"]
    assert data["ours"]["long"]["tokens"] == 2 * 16
