"""The benchmark scenarios' ``--smoke`` paths (tiny models on the CPU, the same code as on the
GPU): each run writes a record whose table has ours, the floor and, where a baseline exists,
the baseline. Plus the S2 FLOP count against torch's FLOP counter (S6's: test_s6_floor.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import s2_flux2_klein as s2
from benchmarks import s3_orpheus as s3
from benchmarks import s4_whisper as s4
from benchmarks import s5_shared_prefix as s5
from benchmarks import s6_parakeet as s6
from benchmarks import s7_tts as s7
from benchmarks import s8_wan22 as s8
from benchmarks.common import LLAMA_3_1_8B


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
    for row in rows.values():
        assert row["ours"] > 0 and row["floor"] > 0 and 0 < row["ours/floor"]
        assert row["baseline"] > 0  # diffusers: the DiT, or the whole Flux2KleinPipeline for an image
    assert "Flux2KleinPipeline" in rows["image@4"]["notes"]["baseline_is"]
    assert data["dit"]["ours_vs_baseline_rel_err"] < 1e-5  # same weights, same function as diffusers


@pytest.mark.slow  # starts an `mstar serve` process (the HTTP routes take images of 256 x 256 and more)
def test_s2_flux2_klein_http_smoke(tmp_path):
    assert s2.main(["--smoke", "--http", "--skip-dit", "--skip-images", "--batches", "1", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s2.NAME)
    assert data["settings"]["width"] == data["settings"]["height"] == 256
    assert rows["image@1 http"]["ours"] > 0 and rows["image@1 http"]["floor"] > 0
    assert "mstar serve" in rows["image@1 http"]["notes"]["ours_is"]
    assert data["http"]["1"]["s_per_image"] == rows["image@1 http"]["ours"]


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
    assert all(row["floor"] > 0 and row["baseline"] > 0 for row in rows.values())  # transformers + snac
    assert data["ours"]["2"]["audio_s_per_stream"] == pytest.approx(4 * 2048 / 24000)


@pytest.mark.slow  # runs the benchmark script end to end
def test_s4_whisper_smoke(tmp_path):
    assert s4.main(["--smoke", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s4.NAME)
    assert set(rows) == {"rtf@1", "rtf@4"}
    for row in rows.values():
        assert row["ours"] > 0 and row["baseline"] > 0 and row["floor"] > 0
        assert row["notes"]["floor_with_cross_kv_reads"] <= row["floor"]


@pytest.mark.slow  # runs the benchmark script end to end
def test_s6_parakeet_smoke(tmp_path):
    """Ours (the device loop forced on, as on CUDA) and transformers' generate decode one
    checkpoint: in fp32 on the CPU their transcripts are the same, token for token. (The tiny
    joint needs a larger blank bias than the full one to say blanks between its tokens.)"""
    assert s6.main(["--smoke", "--runs", "1", "--baseline-runs", "1", "--device-loop", "true",
                    "--blank-bias", "3", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s6.NAME)
    assert set(rows) == {"rtf@1", "rtf@4"} and data["settings"]["device_loop"] is True
    for n, row in ((1, rows["rtf@1"]), (4, rows["rtf@4"])):
        assert row["ours"] > 0 and row["baseline"] > 0 and 0 < row["ours/floor"] < 1
        assert row["notes"]["agreement"] == {"clips_identical": n, "clips": n, "token_edits": 0,
                                             "baseline_tokens": sum(row["notes"]["baseline_tokens_per_clip"]),
                                             "token_error_rate": 0.0}
        tokens, steps = row["notes"]["ours_tokens_per_clip"], row["notes"]["baseline_steps_per_clip"]
        assert all(0 < t < s for t, s in zip(tokens, steps)), "every clip says something, and blanks too"


@pytest.mark.slow  # runs the benchmark script end to end
def test_s7_kokoro_smoke(tmp_path):
    """Ours and the kokoro package speak one checkpoint: every request's audio is there, and
    both sides make about as much of it (ours packs the phonemes into chunks, each with its
    own boundary pads, so not sample for sample)."""
    assert s7.main(["--smoke", "--runs", "1", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s7.NAME)
    assert set(rows) == {"rtf@1", "ttfa@1", "rtf@2", "ttfa@2"}
    assert all(row["ours"] > 0 and row["baseline"] > 0 for row in rows.values())
    for n in ("1", "2"):
        ours, base = data["ours"][n]["runs"][0]["audio_s"], data["baseline"][n]["runs"][0]["audio_s"]
        assert base > 0 and abs(ours - base) < 0.1 * base, (n, ours, base)


def test_s7_chatterbox_smoke(tmp_path):
    """``--model chatterbox``: ours on the family's tiny dummy weights, 1 and 2 requests at
    once, each speaking (here the package does not import beside torch 2.13, so the baseline
    column is empty; its smoke runs in the private venv of tests/chatterbox/record_pipeline.py)."""
    assert s7.main(["--model", "chatterbox", "--smoke", "--runs", "1", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s7.NAME_CHATTERBOX)
    assert set(rows) == {"rtf@1", "ttfa@1", "rtf@2", "ttfa@2"}
    assert all(row["ours"] > 0 for row in rows.values())
    assert all(row["baseline"] is None or row["baseline"] > 0 for row in rows.values())
    for n in ("1", "2"):
        run = data["ours"][n]["runs"][0]
        assert run["audio_s"] > 0 and len(run["ttfa_s"]) == int(n)


@pytest.mark.slow  # runs the benchmark script end to end (two deployments)
def test_s5_shared_prefix_smoke(tmp_path):
    assert s5.main(["--smoke", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s5.NAME)
    assert set(rows) == {"ttft_p50@4", "ttft_p90@4", "throughput@4"}
    for row in rows.values():  # ours is the cache on, the baseline the cache off
        assert row["ours"] > 0 and row["baseline"] > 0 and row["floor"] > 0
    assert data["ours"]["tokens"] == data["baseline"]["tokens"] == 4 * 8
    # reusing the prefix lowers every floor's time
    assert rows["throughput@4"]["floor"] > rows["throughput@4"]["notes"]["floor_without_reuse"]
    assert rows["ttft_p50@4"]["floor"] < rows["ttft_p50@4"]["notes"]["floor_without_reuse"]
    assert set(data["done_when"]) == {"ttft_p50_ratio", "throughput_ratio", "ttft_met", "throughput_met"}


def test_s5_floors_with_and_without_reuse():
    """The prefix reused: its prefill skipped (or done once with --cold-prefix) and its K/V read
    once per decode step; without: every prompt prefilled whole."""
    shape = ["--smoke", "--streams", "64", "--prefix-len", "1024", "--suffix-len", "64", "--new-tokens", "128"]
    settings = s5.settings_from(s5.parse_args(shape))  # the GPU run's shape, on H200-like rates
    roof = s5.s1.Roofline.of(LLAMA_3_1_8B, torch.bfloat16, 4124.0, 761.0)
    warm = s5.floors(settings, roof)
    cold = s5.floors(s5.settings_from(s5.parse_args([*shape, "--cold-prefix"])), roof)
    for name in ("ttft_p50", "ttft_p90", "batch"):
        assert warm[name]["with_reuse"] < cold[name]["with_reuse"] <= warm[name]["without_reuse"]
    assert warm["batch"]["with_reuse"] < warm["batch"]["prefill_reuse_only"] < warm["batch"]["without_reuse"]
    assert s5.first_streams(64, 0.5) == 32 and s5.first_streams(64, 0.9) == 57
    plan = s5.batches(settings)
    assert len(plan) == 1 + settings.runs and all(torch.equal(b.prefix, plan[0].prefix) for b in plan)
    assert len({tuple(s.tolist()) for b in plan for s in b.suffixes}) == len(plan) * settings.streams
    # 64 x (1024 + 64) + 128 tokens: ~4,000 tok/s without reuse, ~9,800 with the prefill reused,
    # ~14,200 with the prefix's K/V also read once per step
    tokens = 64 * 128
    assert tokens / warm["batch"]["without_reuse"] == pytest.approx(4_000, rel=0.05)
    assert tokens / warm["batch"]["prefill_reuse_only"] == pytest.approx(9_800, rel=0.05)


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


@pytest.mark.slow  # a process of its own: Triton's interpreter must be set before Triton is imported
def test_check_gemv_smoke():
    """benchmarks/check_gemv.py --smoke: every variant of every projection (norm prologue,
    separate norm, SiLU * up epilogue) at 16- and 32-column padding, against torch, on the CPU."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "benchmarks/check_gemv.py", "--smoke", "--rows", "3", "20"], cwd=root,
                            env=os.environ | {"PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "all ok" in result.stdout and "FAIL" not in result.stdout


def test_check_whisper_step_smoke():
    """benchmarks/check_whisper_step.py --smoke: Whisper's decoder layers on the GEMV path
    against the previous fused path at 1, 2 and 4 rows, on the CPU (a process of its own)."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "benchmarks/check_whisper_step.py", "--smoke"], cwd=root,
                            env=os.environ | {"PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert result.stdout.count("hidden rel. err") == 3


def test_check_moe_smoke(tmp_path):
    """benchmarks/check_moe.py --smoke (a process of its own, for Triton's interpreter): the
    fused MoE kernels, the expert loop and grouped_mm at 1, 5 and 37 tokens, on the CPU."""
    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "moe.jsonl"
    result = subprocess.run([sys.executable, "benchmarks/check_moe.py", "--smoke", "--json", str(log)], cwd=root,
                            env=os.environ | {"PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "all ok" in result.stdout and "FAIL" not in result.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["tokens"] for r in records] == [1, 5, 37] and all(r["ok"] for r in records)
    assert all(set(r["ms"]) == {"loop", "grouped_mm", "triton"} for r in records)


def test_check_moe_compiles_for_hopper():
    """benchmarks/check_moe.py --compile: the sort and both GEMM kernels at a decode and a
    prefill step, bf16 and fp32, built for sm_90 by the Triton wheel's ptxas (no GPU): they
    compile, fit a block's shared memory, and the bf16 K loops are software-pipelined."""
    import importlib.util

    spec = importlib.util.find_spec("triton")  # found, not imported: this process may interpret kernels
    if spec is None or not (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("needs the triton package with its NVIDIA backend")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "benchmarks/check_moe.py", "--compile", "--tokens", "1", "4096"],
                            cwd=root, env=os.environ | {"PYTHONPATH": str(root)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    gemms = [line for line in lines if "_gate_up_kernel" in line or "_down_kernel" in line]
    assert len(gemms) == 8 and sum("_sort_pairs_kernel" in line for line in lines) == 1
    assert all("not pipelined" not in line for line in gemms if "bf16" in line)
    assert sum("wgmma" in line for line in gemms) == 2  # the 128-row prefill blocks take Hopper's MMA
    assert "all ok" in lines


@pytest.mark.slow  # runs the benchmark script end to end
def test_s8_wan22_smoke(tmp_path):
    assert s8.main(["--smoke", "--out", str(tmp_path)]) == 0
    data, rows = record(tmp_path, s8.NAME)
    kinds = ("eager", "compiled", "compiled, ours with one time per row (t2v)")
    expected = {f"dit_step@{n} {k}" for n in (1, 2) for k in kinds}
    assert set(rows) == expected | {"clip eager baseline", "clip compiled baseline"}
    for row in rows.values():
        assert row["ours"] > 0 and row["baseline"] > 0 and row["floor"] > 0 and 0 < row["ours/floor"]
    assert data["dit"]["ours_vs_baseline_rel_err"] < 1e-5  # same weights, same function as diffusers
    assert "WanPipeline" in rows["clip eager baseline"]["notes"]["baseline_is"]


def test_s8_flop_count_matches_torch_counter():
    """The counted DiT FLOPs equal torch's counter over the products outside attention plus the
    attention products."""
    from mstar.model.wan22.config import WanTransformerConfig
    from mstar.model.wan22.transformer import WanTransformer

    cfg, text, rows = s8.TINY_DIT, 7, 2
    model = WanTransformer(WanTransformerConfig.from_dict(cfg))
    latents, frames_rows_cols = torch.randn(rows, cfg["in_channels"], 3, 4, 6), (3, 2, 3)
    tokens = frames_rows_cols[0] * frames_rows_cols[1] * frames_rows_cols[2]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(latents, torch.rand(rows) * 1000, torch.randn(rows, text, cfg["text_dim"]))
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    attention = rows * cfg["num_layers"] * 2 * (2 * tokens * tokens * d + 2 * tokens * text * d)
    products = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "attention" not in str(op))
    assert products + attention == s8.dit_step_flops(cfg, tokens, text, rows)


@pytest.mark.slow  # builds and compiles the tiny models
def test_s8_parts_smoke(tmp_path):
    """The parts tool on S8's tiny configs: every VAE variant and UMT5 side timed, the DiT step
    compiled and timed, one record written."""
    from benchmarks import s8_parts

    assert s8_parts.main(["--smoke", "--runs", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob(f"{s8_parts.NAME}-*.json")
    data = json.loads(path.read_text())
    assert {"diffusers_fp32", "ours_fp32", "ours_fp32_fused", "ours_bf16_fused"} <= set(data["vae"])
    assert data["vae"]["ours_vs_diffusers_levels"] <= 1  # same weights, same video to a level
    assert data["umt5"]["ours"] > 0 and data["umt5"]["transformers"] > 0 and data["dit"]["ms"] > 0
