"""S15 (Nemotron VoiceChat live calls): the ``--smoke`` run end to end on the tiny deployment
(both pacings, the node profile), the tick floor's weight bytes against the modules' own
parameters, and the tick and lag figures on fabricated call clocks."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from benchmarks import s15_nemotron_duplex as s15
from benchmarks.live_calls import CallTiming, summarise
from mstar.model.nemotron_duplex.config import DuplexConfig
from mstar.model.nemotron_duplex.modeling import build_models
from tests.support.records import FLOOR_SLACK


@pytest.mark.slow  # runs the benchmark script end to end (about 10 s)
def test_smoke_run_writes_every_row(tmp_path) -> None:
    assert s15.main(["--smoke", "--profile", "--stagger-s", "0.16", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s15.NAME}-*.json")
    data = json.loads(path.read_text())
    assert data["hardware"]["torch"] and not data["errors"] and data["baseline"] is None
    rows = {m["metric"]: m for m in data["metrics"]}
    kinds = ("tick_p50", "tick_p90", "tick_max", "first_frame", "frames_per_s", "lag_p50", "lag_p90", "lag_max",
             "first_frame_live", "realtime_calls")
    assert set(rows) == {f"{k}@{n}" for k in kinds for n in (1, 2)}
    for name, row in rows.items():
        assert row["floor"] > 0 and row["baseline"] is None, name
        if not name.startswith("realtime_calls"):
            assert row["ours"] > 0 and 0 < row["ours/floor"] < FLOOR_SLACK, name
    for n in (1, 2):
        fast, live = data["ours"]["fast"][str(n)], data["ours"]["realtime"][str(n)]
        for got in (fast, live):
            assert got["frames_per_call"] == 11  # 10 appends of 80 ms: 11 agent frames, each with its PCM
            assert got["tick_ms_p50"] <= got["tick_ms_p90"] <= got["tick_ms_max"]
            assert 0 <= got["calls_within_real_time"] <= n
        assert live["lag_ms_p50"] <= live["lag_ms_p90"] <= live["lag_ms_max"]
        assert 0 <= rows[f"realtime_calls@{n}"]["ours"] <= n == rows[f"realtime_calls@{n}"]["floor"]
        # realtime: the calls cannot outrun the appends (12.5 frames a second each, at most)
        assert live["frames_per_s"] <= n * 12.5 * 1.15
        nodes = fast["node_ms"]
        assert set(nodes) == {"conformer_encoder", "nano_llm", "eartts_talker"}
        assert all(v["steps"] >= 11 and v["ms_per_step"] > 0 for v in nodes.values())
    assert rows["tick_p50@1"]["notes"]["reference_h100_tick_ms"] == [24, 25]
    assert rows["tick_p50@2"]["floor"] >= rows["tick_p50@1"]["floor"]
    assert data["settings"]["outputs"] == "text,audio" and data["settings"]["stagger_s"] == 0.16
    assert data["ours"]["startup_s"] > 0


def test_sigterm_keeps_the_rounds_that_ran(tmp_path, monkeypatch) -> None:
    run = s15.OursRunner.run

    def run_or_stop(self, n, pace, appends, **kwargs):
        if pace == "realtime":  # as ``timeout`` would, once the fast round is done
            os.kill(os.getpid(), signal.SIGTERM)
        return run(self, n, pace, appends, **kwargs)

    monkeypatch.setattr(s15.OursRunner, "run", run_or_stop)
    before = signal.getsignal(signal.SIGTERM)
    assert s15.main(["--smoke", "--calls", "1", "--out", str(tmp_path)]) == 1
    [path] = tmp_path.glob(f"{s15.NAME}-*.json")
    data = json.loads(path.read_text())
    assert data["errors"] == {"stopped": "SIGTERM during realtime@1: it and the rounds after it did not run"}
    rows = {m["metric"]: m for m in data["metrics"]}
    assert rows["tick_p50@1"]["ours"] > 0 and rows["lag_p50@1"]["ours"] is None
    assert signal.getsignal(signal.SIGTERM) == before  # the handler was put back


def test_floor_weight_bytes_are_the_modules_parameters(tmp_path) -> None:
    config = DuplexConfig.from_dir(s15.write_model_dir(tmp_path / "m", smoke=True))
    floor = s15.Floor.of(config, torch.bfloat16, bandwidth_gbs=100.0, matmul_tflops=1.0)
    encoder, llm = build_models(config)

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    from mstar.model.eartts.checkpoint import EarTTS

    tts = EarTTS(config.talker)
    assert floor.weight_bytes["encoder"] == 4 * count(encoder)  # the engine keeps the encoder in float32
    assert floor.weight_bytes["nano_llm"] == 2 * (count(llm) - llm.backbone.embeddings.weight.numel())
    assert floor.weight_bytes["codec"] == 2 * count(tts.codec)
    head = tts.talker.mog_head
    gathered = head.proj_mus.weight.numel() + head.low_mat.numel()
    once = count(tts.talker) - gathered  # every talker weight read once, but the chosen components' rows
    assert 2 * once < floor.weight_bytes["eartts_talker"] <= 2 * (once + 8 * count(head) + tts.talker.rvq_embs.numel())
    weights = sum(floor.weight_bytes.values())
    assert floor.tick_s(1, 0, 0, weights_only=True) == pytest.approx(weights / 100e9)
    assert floor.tick_s(1, 0, 0, weights_only=True) < floor.tick_s(1, 10, 10) < floor.tick_s(4, 10, 10)
    half = s15.Floor.of(config, torch.bfloat16, bandwidth_gbs=100.0, matmul_tflops=1.0, encoder_dtype=torch.bfloat16)
    assert half.weight_bytes["encoder"] == 2 * count(encoder)  # --encoder-dtype bfloat16
    assert 2 * half.encoder_cache_bytes_per_call == floor.encoder_cache_bytes_per_call


def test_encoder_dtype_reaches_the_deployment(tmp_path) -> None:
    settings = s15.settings_from(s15.parse_args(["--smoke", "--encoder-dtype", "bfloat16"]))
    assert settings.encoder_dtype == "bfloat16" and settings.describe()["encoder_dtype"] == "bfloat16"
    model_dir = s15.write_model_dir(tmp_path / "m", smoke=True)
    assert s15.deployment(settings, model_dir)["model_kwargs"]["encoder_dtype"] == "bfloat16"
    plain = s15.settings_from(s15.parse_args(["--smoke"]))
    assert plain.encoder_dtype == "float32" and "bf16 encoder" not in s15.scenario_name(plain)
    assert "bf16 encoder" in s15.scenario_name(settings)  # its rows apart from the float32 encoder's


def _call(arrivals: list[float], dues: list[float]) -> CallTiming:
    return CallTiming(submitted=0.0, due=dues, text=list(arrivals), audio=list(arrivals))


def test_ticks_and_lags_on_fabricated_clocks() -> None:
    dues = [0.075 * k for k in range(13)]  # appends a little faster than real time
    steady = _call([d + 0.05 for d in dues], dues)  # 50 ms behind each append, all the way
    falling = _call([d + 0.05 + 0.02 * k for k, d in enumerate(dues)], dues)  # 20 ms more each frame
    got = summarise([(2.0, [steady, falling])], "realtime", speech=True)
    assert got["lag_ms_p50"] == pytest.approx(50) and got["lag_ms_p90"] == pytest.approx(50 + 20 * 10)
    assert got["lag_ms_max"] == pytest.approx(50 + 20 * 12)
    assert got["calls_kept_up"] == 1  # the falling call's lag grew 180 ms from its first quarter to its last
    assert got["calls_within_real_time"] == 1  # its frames came every 95 ms
    assert got["tick_ms_p50"] == pytest.approx(85) and got["tick_ms_max"] == pytest.approx(95)
    assert got["first_frame_ms_p50"] == pytest.approx(50) and got["frames_per_s"] == pytest.approx(13)
