"""S11 (world models): the ``--smoke`` path end to end on the CPU (both families' deployments,
1 and 4 rollouts at once, every event stamped), the event statistics on fabricated times, and
the floor at the released shapes: its parameter counts against diffusers' Wan2.1 DiT, UMT5-XXL,
the Wan2.1 VAE and Waypoint's model card, and its attention growing with the history as a
direct count says."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from benchmarks import s11_world as s11

RATES = {"bf16": 800.0, "tf32": 400.0}


def test_smoke_runs_both_families(tmp_path):
    assert s11.main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s11.NAME}-*.json")
    data = json.loads(path.read_text())
    assert not data["errors"]
    rows = {m["metric"]: m for m in data["metrics"]}
    names = {f"{family} {metric}@{n}" for n in (1, 4) for family, unit, plural in
             (("lingbot", "chunk", "chunks"), ("waypoint", "step", "steps"))
             for metric in (f"{plural}/s", "frames/s", f"{unit} interval p50", f"{unit} interval p90", f"first {unit}")}
    assert names == set(rows)
    for name, row in rows.items():
        # ours/floor is not bounded here: the floor rests on rates measured on a CPU that other work shares
        assert row["ours"] > 0 and row["floor"] > 0 and row["ours/floor"] > 0, name
        assert row["baseline"] is None and "flash-attn" in row["notes"]["baseline_is"], name
    assert "flash-attn" in data["baseline"]["unavailable"]
    settings = data["settings"]
    chunks, controls, frames = settings["chunks"], settings["controls"], settings["num_frames"]
    assert frames == 12 * chunks - 3
    for n in (1, 4):
        assert rows[f"lingbot frames/s@{n}"]["ours"] == pytest.approx(rows[f"lingbot chunks/s@{n}"]["ours"] * frames
                                                                      / chunks)
        assert rows[f"waypoint frames/s@{n}"]["ours"] == pytest.approx(4 * rows[f"waypoint steps/s@{n}"]["ours"])
        for family, events in (("lingbot", chunks), ("waypoint", controls)):
            [run] = data["ours"][family][str(n)]["runs"]  # one timed round in the smoke
            assert len(run["events_s"]) == n  # one list of event times per rollout
            for times in run["events_s"]:
                assert len(times) == events and times == sorted(times) and 0 < times[-1] <= run["wall_s"]


def test_event_statistics():
    runs = [{"wall_s": 2.0, "events_s": [[0.5, 0.6, 0.8], [0.7, 1.0, 1.4]]},
            {"wall_s": 4.0, "events_s": [[0.3, 0.4, 0.5], [0.9, 1.1, 1.2]]}]
    out = s11.summarise(runs, n=2, events=3, frames=9)
    assert out["wall_s_median"] == 3.0
    assert out["events_per_s"] == pytest.approx(2 * 3 / 3.0) and out["frames_per_s"] == pytest.approx(2 * 9 / 3.0)
    # intervals 0.1 0.2 0.3 0.4 0.1 0.1 0.2 0.1: p50 0.1 and 0.2 halfway (0.15), p90 between 0.3 and 0.4
    assert out["interval_ms_p50"] == pytest.approx(150.0)
    assert out["interval_ms_p90"] == pytest.approx(1e3 * (0.3 + 0.3 * (0.4 - 0.3)))
    assert out["first_event_ms_p50"] == pytest.approx(1e3 * (0.5 + 0.7) / 2)
    one = s11.summarise([{"wall_s": 1.0, "events_s": [[0.2]]}], n=1, events=1, frames=4)
    assert "interval_ms_p50" not in one and one["first_event_ms_p50"] == pytest.approx(200.0)


def released(**more) -> s11.Settings:
    settings = s11.settings_from(s11.parse_args(["--smoke"]))
    return dataclasses.replace(settings, dtype=torch.bfloat16, lingbot_dit=dict(s11.LINGBOT_DIT),
                               lingbot_text=dict(s11.UMT5_XXL), lingbot_vae=dict(s11.WAN21_VAE),
                               waypoint_dit=dict(s11.WAYPOINT_DIT), waypoint_ae=dict(s11.TAEHV_1_5), **more)


def test_lingbot_floor_counts_the_released_model():
    """Wan2.1-1.3B's DiT with 36 input channels (diffusers' count) plus LingBot's camera layers,
    UMT5-XXL's encoder, the 127M-parameter Wan2.1 VAE; a chunk's DiT work grows linearly with the
    history it attends to."""
    from diffusers import WanTransformer3DModel

    floor = s11.lingbot_floor(released(width=416, height=240, chunks=3), 4000.0, RATES)
    with torch.device("meta"):
        wan = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                    in_channels=36, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                                    num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
    d = 1536
    camera = 384 * 4 * d + d + 2 * (d * d + d) + 30 * 4 * (d * d + d)  # rays in, their MLP, 4 layers a block
    assert floor.params["dit"] == sum(p.numel() for p in wan.parameters()) + camera
    assert 5.6e9 < floor.params["text_encoder"] < 5.7e9
    assert 126e6 < floor.params["vae"] < 128e6
    dit = [event[0] for event in floor.events]
    assert dit[2].flops - dit[1].flops == pytest.approx(dit[1].flops - dit[0].flops)  # attention over the history
    assert dit[1].flops > dit[0].flops and dit[0].bytes == pytest.approx(5 * 2 * floor.params["dit"], rel=0.01)
    assert floor.event_s(2) > floor.event_s(1) > floor.event_s(0) > 0


def test_lingbot_history_cost_matches_a_direct_count():
    """The floor's per-history-frame extrapolation equals torch's count of a forward after two
    committed chunks (tiny shapes)."""
    from mstar.model.lingbot.checkpoint import config_from_reference
    from mstar.model.lingbot.config import LingbotConfig
    from mstar.model.lingbot.transformer import LingbotTransformer

    settings = s11.settings_from(s11.parse_args(["--smoke", "--chunks", "3"]))
    floor = s11.lingbot_floor(settings, 10.0, RATES)
    config = config_from_reference(settings.lingbot_dit, LingbotConfig())
    c, h, w = config.chunk_frames, settings.height // 8, settings.width // 8
    with torch.device("meta"):
        dit = LingbotTransformer(config)
        x = torch.zeros(1, 36, c, h, w)
        text, rays = torch.zeros(1, config.text_len, config.dit.text_dim), torch.zeros(1, 384, c, h, w)
        t = torch.zeros(1)
    cache = dit.new_cache()
    for _ in range(2):
        dit(x, t, text, rays, cache, commit=True)
    direct = s11.counted_flops(lambda: dit(x, t, text, rays, cache))
    steps = len(config.timestep_indices)
    assert floor.events[2][0].flops == pytest.approx((steps + 1) * direct)


def test_waypoint_floor_counts_the_released_model():
    """The model card's 1.28B DiT; the attention over kept frames grows until the windows fill
    (local 16 frames, global 16 slots every 8th frame), then stays."""
    floor = s11.waypoint_floor(released(controls=130), 4000.0, RATES)
    assert 1.27e9 < floor.params["dit"] < 1.29e9
    dit = [event[0] for event in floor.events]
    weights = 5 * 2 * floor.params["dit"]  # 4 sigma steps and the clean pass, bf16
    assert weights < dit[0].bytes < 1.03 * weights  # and the seed frame's keys and values
    assert dit[1].flops > dit[0].flops and dit[20].flops > dit[10].flops
    assert dit[128].flops == pytest.approx(dit[129].flops)  # every window full from frame 128 on
    decode = [event[1] for event in floor.events]
    assert decode[0].flops > decode[1].flops == decode[2].flops  # the first decode primes the stream
