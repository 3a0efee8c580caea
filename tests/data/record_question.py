"""Records ``question_24k.wav``: espeak-ng (Debian's espeak-ng 1.51, voice en-us, 150 words a
minute) saying "What is the capital of France?", resampled from its 22,050 Hz to the 24 kHz
mono 16-bit PCM the Realtime API takes, with half a second of silence after it (the end of
the user's turn for server VAD). Run once, by hand: ``python tests/data/record_question.py``
(needs ``apt-get install espeak-ng``); the WAV is committed."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf
from scipy.signal import resample_poly

TEXT = "What is the capital of France?"
OUT = Path(__file__).with_name("question_24k.wav")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "q.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(raw), TEXT], check=True)
        samples, rate = sf.read(raw, dtype="float32")
    assert rate == 22050, rate
    at_24k = resample_poly(samples, 160, 147).astype(np.float32)  # 24000 / 22050 = 160 / 147
    at_24k = np.concatenate([at_24k, np.zeros(12000, np.float32)])
    sf.write(OUT, at_24k, 24000, subtype="PCM_16")
    print(f"{OUT}: {len(at_24k) / 24000:.2f} s")


if __name__ == "__main__":
    main()
