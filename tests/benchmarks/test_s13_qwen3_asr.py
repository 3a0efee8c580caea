"""S13 (Qwen3-ASR transcription): the ``--smoke`` path end to end on the CPU (ours and
transformers' ``generate`` on the same dummy weights, token for token), the clean skip on a
transformers without ``qwen3_asr``, and the floor's parameter counts against transformers' model
at the 1.7B release's shapes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_asr")
from benchmarks import s13_qwen3_asr as s13  # noqa: E402
from tests.support.records import FLOOR_SLACK


def test_smoke_runs_ours_and_the_baseline(tmp_path, monkeypatch):
    """Dummy weights of std 0.5 (not 0.02) so the tiny model's greedy ids vary; both sides draw
    them through the same function, so they must still agree id for id."""
    import mstar.model.weights as weights

    plain = weights.init_dummy_weights
    monkeypatch.setattr(weights, "init_dummy_weights", lambda module, seed=0, std=0.02: plain(module, seed, 0.5))
    assert s13.main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s13.NAME}-*.json")
    data = json.loads(path.read_text())
    assert not data["errors"]
    rows = {m["metric"]: m for m in data["metrics"]}
    assert set(rows) == {f"{m}@{n}" for m in ("s/batch", "clips/s", "RTF", "TTFT") for n in (1, 4)}
    for name, row in rows.items():
        assert row["ours"] > 0 and row["floor"] > 0 and 0 < row["ours/floor"] < FLOOR_SLACK, name
        assert (row["baseline"] is None) == name.startswith("TTFT"), name
        assert row["notes"]["transcripts_equal"] == 1.0 and row["notes"]["ids_agree_before_first_difference"] == 1.0
    clip_s = data["settings"]["clip_s"]
    for n in (1, 4):
        wall = rows[f"s/batch@{n}"]["ours"]
        assert rows[f"clips/s@{n}"]["ours"] == pytest.approx(n / wall)
        assert rows[f"RTF@{n}"]["ours"] == pytest.approx(n * clip_s / wall)
        assert rows[f"TTFT@{n}"]["ours"] < 1e3 * wall
    ids = data["ours"]["4"]["ids"][0]
    assert len(ids) == data["settings"]["new_tokens"] and len(set(ids)) > 1  # a real check, not one repeated id
    assert ids == data["baseline"]["4"]["ids"][0]
    # 3 s: 300 mel frames, 3 chunks of 13 positions; the prompt's markers around them
    assert data["ours"]["prompt_len"] == rows["RTF@1"]["notes"]["prompt_tokens"] == 39 + 10


def test_baseline_missing_is_a_clean_skip(tmp_path, monkeypatch):
    """As on a transformers without ``qwen3_asr`` (5.17): the modules cannot be imported."""
    import sys

    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    for name in ("Qwen3ASRConfig", "Qwen3ASRForConditionalGeneration", "Qwen3ASRFeatureExtractor"):
        monkeypatch.delattr(transformers, name, raising=False)
    for module in ("transformers.models.qwen3_asr", "transformers.models.qwen3_asr.configuration_qwen3_asr",
                   "transformers.models.qwen3_asr.modeling_qwen3_asr",
                   "transformers.models.qwen3_asr.feature_extraction_qwen3_asr"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(s13.BaselineUnavailable):
        s13.reference_classes()
    assert s13.main(["--smoke", "--runs", "1", "--batches", "1", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"{s13.NAME}-*.json")
    data = json.loads(path.read_text())
    assert not data["errors"] and "5.17" in data["baseline"]["unavailable"]
    rows = {m["metric"]: m for m in data["metrics"]}
    assert set(rows) == {"s/batch@1", "clips/s@1", "RTF@1", "TTFT@1"}
    assert all(r["ours"] > 0 and r["baseline"] is None for r in rows.values())


def test_floor_counts_the_released_model():
    """The roofline's parts add up to transformers' parameters at Qwen3-ASR-1.7B's shapes, and
    its phases scale: the encoder with the clips, a decode step's weights read once per batch."""
    from transformers import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    settings = s13.settings_from(s13.parse_args(["--smoke"]))
    settings = dataclasses.replace(settings, audio=dict(s13.RELEASED_AUDIO), text=dict(s13.RELEASED_TEXT),
                                   special=dict(s13.RELEASED_SPECIAL))
    config = {"thinker_config": {"audio_config": settings.audio, "text_config": settings.text,
                                 "audio_token_id": settings.special["<|audio_pad|>"]}}
    roof = s13.ASRRoofline.build(config, 2, 1000.0, 100.0)
    with torch.device("meta"):
        theirs = Qwen3ASRForConditionalGeneration(Qwen3ASRConfig(
            audio_config=settings.audio, text_config=settings.text, audio_token_id=151676))
    assert roof.total_params == sum(p.numel() for p in theirs.parameters())
    assert 2.0e9 < roof.total_params < 2.5e9
    frames = 3000  # 30 s
    assert roof.config.audio.positions(frames) == 390
    one, many = roof.batch_s(1, frames, 400, 100), roof.batch_s(32, frames, 400, 100)
    assert many["encoder_s"] == pytest.approx(32 * one["encoder_s"])
    step_bytes = (roof.decoder_params + roof.head_params) * 2
    assert one["decode_s"] >= 99 * step_bytes / 1e12  # batch 1: at least the weights once a step
    assert one["floor_s"] == pytest.approx(one["encoder_s"] + one["prefill_s"] + one["decode_s"])
    assert 0.2e12 < roof.encoder_flops(frames) < 2e12  # about 2 x 0.3 B weights x 390 positions and the convs


def test_released_model_dir_gives_the_30_s_prompt(tmp_path):
    """The GPU run's directory: the config reads back at the 1.7B shapes and the 151,936-word
    tokenizer puts the chat markers at the release's ids (390 audio rows, 400 prompt ids)."""
    from transformers import AutoTokenizer

    from mstar.model.qwen3_asr.checkpoint import Qwen3ASRCheckpoint

    settings = dataclasses.replace(s13.settings_from(s13.parse_args(["--smoke"])), audio=dict(s13.RELEASED_AUDIO),
                                   text=dict(s13.RELEASED_TEXT), special=dict(s13.RELEASED_SPECIAL))
    directory = s13.write_model_dir(settings, tmp_path / "model")
    config = Qwen3ASRCheckpoint(directory).config()
    assert (config.llm.num_hidden_layers, config.llm.vocab_size, config.audio.encoder_layers) == (28, 151936, 24)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = s13.prompt_ids(tokenizer, config.audio.positions(3000), config.audio_token_id)
    assert len(ids) == 400 and ids.count(151676) == 390
    assert ids[:3] == [151644, s13.PLAIN_WORDS.index("system"), 151645] and ids[-1] == 2  # "assistant"
    assert len(s13.speech_like(30.0, 1)) == 480000
