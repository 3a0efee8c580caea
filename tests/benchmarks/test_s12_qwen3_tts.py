"""S12 (Qwen3-TTS streaming): the smoke run end to end on the tiny checkpoint, the talker
step's weight bytes against the modules' own parameters, the stream figures."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import s12_qwen3_tts as s12
from benchmarks.s3_orpheus import StreamTiming
from mstar.model.qwen3_tts import engine
from mstar.model.qwen3_tts.config import Qwen3TTSConfig
from mstar.model.qwen3_tts.talker import Qwen3TTSTalker
from tests.support.qwen3_tts_dir import TALKER


def test_smoke_run_writes_every_row(tmp_path) -> None:
    assert s12.main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s12.NAME}-*.json")
    data = json.loads(path.read_text())
    assert data["hardware"]["torch"] and not data["errors"] and data["baseline"] is None
    assert "transformers 4.57.3" in data["baseline_missing"]
    rows = {m["metric"]: m for m in data["metrics"]}
    kinds = ("ttfa_p50", "ttfa_p90", "rtf_min", "viable", "frames_per_s")
    assert set(rows) == {f"{k}@{n}" for k in kinds for n in (1, 2)}
    for name, row in rows.items():
        assert row["floor"] > 0 and row["baseline"] is None, name
        assert row["ours"] > 0 or name.startswith("viable"), name
    for n in (1, 2):
        ours = data["ours"][str(n)]
        assert ours["ttfa_ms_p50"] <= ours["ttfa_ms_p90"] <= ours["ttfa_ms_max"]
        assert ours["audio_s_per_stream"] == pytest.approx(8 * 48 / 24000)  # every request spoke 8 frames
        assert 0 <= ours["viable_streams"] <= n and ours["chunks_per_stream"] >= 2  # the ramp: 1, 3, 4 frames
        assert rows[f"viable@{n}"]["floor"] == n
    assert rows["ttfa_p50@1"]["notes"]["target_ms"] == s12.TARGET_TTFA_MS
    assert engine.MIN_FRAMES == 2  # the run put the family's EOS rule back


@pytest.mark.parametrize("predictor_width", [24, 32])  # behind a projection (1.7B), or as wide as the talker
def test_step_weight_bytes_are_the_modules_parameters(predictor_width: int) -> None:
    d = {**TALKER, "code_predictor_config": {**TALKER["code_predictor_config"], "hidden_size": predictor_width}}
    tts = Qwen3TTSConfig.from_hf_dict({"talker_config": d})
    talker = Qwen3TTSTalker(tts.talker)

    def count(*modules) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    pred = talker.code_predictor
    passes = tts.talker.num_code_groups - 1
    expected = (count(talker.model.layers, talker.model.norm, talker.codec_head)
                + passes * count(pred.model.layers, pred.model.norm, pred.small_to_mtp_projection)
                + count(pred.lm_head))
    roof = s12.Roofline.of(tts, 48, torch.bfloat16, bandwidth_gbs=100.0, matmul_tflops=1.0)
    assert roof.weight_bytes_read == 2 * expected
    assert roof.step_s(1) == pytest.approx(2 * expected / 100e9)
    assert roof.step_s(10**9) == pytest.approx(10**9 * roof.flops_per_token / 1e12)  # compute-bound at last


def test_released_shapes_are_a_1p7b_model() -> None:
    tts = Qwen3TTSConfig.from_hf_dict({"talker_config": s12.TALKER_1P7B})
    with torch.device("meta"):
        talker = Qwen3TTSTalker(tts.talker)
    total = sum(p.numel() for p in talker.parameters())
    assert 1.6e9 < total < 2.0e9
    roof = s12.Roofline.of(tts, 1920, torch.bfloat16, 4800.0, 900.0)
    assert 5.0e9 < roof.weight_bytes_read < 5.6e9  # the predictor's 15 passes are ~45% of it
    assert roof.frame_s == pytest.approx(0.08)


def test_summary_counts_viable_streams_and_the_slowest() -> None:
    rate = s12.FLOAT_BYTES_PER_S
    steady = StreamTiming(0.0, 0.05, 1.05, 2 * rate, [(0.05 + 0.5 * i, rate // 2) for i in range(4)])
    stalls = StreamTiming(0.0, 0.04, 3.04, 2 * rate, [(0.04, rate // 2), (3.04, 3 * rate // 2)])
    out = s12.summarise(2, 25, 0.08, [(3.04, [steady, stalls])])
    assert out["viable_streams"] == 1 and out["viable_share"] == 0.5
    assert out["rtf_min"] == pytest.approx(2.0 / 3.04) and out["rtf_median"] == pytest.approx((2 / 1.05 + 2 / 3.04) / 2)
    assert out["ttfa_ms_p50"] == pytest.approx(45.0) and out["ttfa_ms_p90"] == pytest.approx(50.0)
    assert out["frames_per_s"] == pytest.approx(50 / 3.04)


def test_smoke_run_with_the_fast_path_flags(tmp_path) -> None:
    """The flags reach the deployment's knobs (the graph ones ignored on the CPU) and
    ``--profile`` records a talker step's host time per stream count."""
    assert s12.main(["--smoke", "--streams", "1", "--overlap", "--cuda-graphs", "--profile", "--codec-ramp",
                     "adaptive", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s12.NAME}-*.json")
    data = json.loads(path.read_text())
    assert data["settings"]["overlap_scheduling"] and not data["settings"]["cuda_graphs"]
    assert data["settings"]["codec_ramp"] == "adaptive" and data["ours"]["1"]["audio_s_per_stream"] > 0
    settings = s12.settings_from(s12.parse_args(["--smoke", "--codec-ramp", "adaptive"]))
    assert s12.deployment(settings, tmp_path)["model_kwargs"]["codec_ramp"] == "adaptive"
    profile = data["ours"]["1"]["profile"]
    assert profile["steps"] >= 8 and profile["host_ms_per_step"] > 0
    # the adaptive ramp's first window as the rule saw it: one window, nothing buffered yet
    first = data["ours"]["1"]["ramp"]["0"]
    assert sum(first["sizes"].values()) >= 1 and first["buffer_ms"] == [0.0, 0.0, 0.0]
    from mstar.model.qwen3_tts.engine import TalkerEngine
    from mstar.model.qwen3_tts.ramp import RampRule

    assert RampRule.release.__name__ == "release" and TalkerEngine.run.__name__ == "run"  # unpatched after


def test_the_dry_report_names_the_late_chunk() -> None:
    second = s12.FLOAT_BYTES_PER_S // 1  # bytes of one second of audio
    fed = StreamTiming(0.0, 0.1, 1.0, 0, [(0.1, int(0.08 * second)), (0.15, int(0.24 * second))])
    late = StreamTiming(0.0, 0.1, 1.0, 0, [(0.1, int(0.08 * second)), (0.25, int(0.24 * second)),
                                          (0.4, int(0.64 * second))])
    assert s12.first_dry(fed, s12.FLOAT_BYTES_PER_S) is None and fed.viable(s12.FLOAT_BYTES_PER_S)
    index, ms = s12.first_dry(late, s12.FLOAT_BYTES_PER_S)
    assert index == 1 and ms == pytest.approx(70.0) and not late.viable(s12.FLOAT_BYTES_PER_S)
    report = s12.dry_report([fed, late])
    assert report["first_dry_chunk"] == {1: 1} and report["late_ms_max"] == pytest.approx(70.0)
    assert report["a_dry_stream_chunks"] == [(0.0, 80.0), (150.0, 240.0), (300.0, 640.0)]
    assert s12.dry_report([fed]) == {}
