"""``mstar watermark detect FILE``: a tiny seeded AudioSeal detector (a checkpoint file) on a
clip our generator marked, the printed probability and message equal to the detector's own
verdict, as text and JSON, with the expected payload compared, a file at another rate
resampled, and bad input reported in one line with exit status 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
import torch

from mstar.audio.io import resample
from mstar.cli import main
from mstar.model import audio_watermark as aw

TINY = {"nbits": 16, "seanet": {"causal": True, "dimension": 8, "n_filters": 4, "ratios": [4, 2], "lstm": 1}}


def _seeded(cls, seed: int):
    torch.manual_seed(seed)
    model = cls(aw.SEANetConfig.from_dict(TINY)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("wm_cli")
    detector = _seeded(aw.AudioSealDetector, 1)
    torch.save({"xp.cfg": TINY, "model": detector.state_dict()}, root / "detector.pth")
    torch.manual_seed(3)
    marked = _seeded(aw.AudioSealGenerator, 0)(0.1 * torch.randn(1, 1, 2400), message=0xBEEF, alpha=0.3)[0, 0]
    sf.write(root / "marked.wav", marked.numpy(), 24000, subtype="FLOAT")
    sf.write(root / "marked16k.wav", resample(marked.numpy(), 24000, 16000), 16000, subtype="FLOAT")
    return root, detector, marked


def test_detect_prints_the_detectors_verdict(files, capsys) -> None:
    root, detector, marked = files
    want = detector.detect(marked)
    assert main(["watermark", "detect", str(root / "marked.wav"), "--detector", str(root / "detector.pth"),
                 "--json", "--message", "0xBEEF"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["probability"] == pytest.approx(want.probability, abs=1e-6) and got["message"] == want.message
    assert got["message_bits"] == format(want.message, "016b") and got["rate"] == got["file_rate"] == 24000
    assert got["message_matches"] is (want.message == 0xBEEF)
    assert main(["watermark", "detect", str(root / "marked.wav"), "--detector", str(root / "detector.pth")]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text == [f"probability: {want.probability:.4f}",
                    f"message: {want.message} (0x{want.message:04X}, {want.message:016b})"]


def test_detect_resamples_to_the_marking_rate(files, capsys) -> None:
    root, detector, _ = files
    assert main(["watermark", "detect", str(root / "marked16k.wav"), "--detector", str(root / "detector.pth"),
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    samples, _ = sf.read(root / "marked16k.wav", dtype="float32")
    want = detector.detect(torch.from_numpy(np.asarray(resample(samples, 16000, 24000), np.float32)))
    assert (got["file_rate"], got["rate"]) == (16000, 24000)
    assert got["probability"] == pytest.approx(want.probability, abs=1e-6) and got["message"] == want.message


def test_detect_errors_are_one_line(files, capsys, monkeypatch) -> None:
    root, _, _ = files
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert main(["watermark", "detect", str(root / "marked.wav")]) == 2  # the default card, not cached
    assert "'audioseal_detector_streaming'" in capsys.readouterr().err
    assert main(["watermark", "detect", str(root / "marked.wav"), "--detector", str(root / "none.pth")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mstar watermark detect: error:") and "\n" not in err
    assert main(["watermark", "detect", str(root / "marked.wav"), "--detector", str(root / "detector.pth"),
                 "--message", "0x1FFFF"]) == 2
    assert "message" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["watermark", "detect", str(root / "missing.wav")])
