"""Each key served at the released shapes with dummy weights (``load_format: dummy``), in
process on the CPU: the real-size T3, S3Gen, clip encoders and PerTh build, and a short
request (three speech tokens) comes back as 24 kHz audio of the expected length. Slow: a few
GB of weights per key."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mstar.config import parse_config
from mstar.contract import SpeechSpec
from mstar.model.speech_output import pcm_to_array
from mstar.runtime.launch import start

pytestmark = pytest.mark.slow

SAMPLES_PER_TOKEN = 960  # two mel frames of 480 samples at 24 kHz


@pytest.mark.parametrize("key", ["chatterbox", "chatterbox_multilingual", "chatterbox_turbo"])
def test_real_shapes_speak(key):
    config = parse_config({"model": key, "load_format": "dummy", "device": "cpu",
                           "node_groups": [{"node_names": ["t3", "s3gen"], "ranks": [0]}]})
    deployment = start(config, in_process=True)
    try:
        async def run():
            spec = SpeechSpec("r", "Hi.", None, 1.0, {"seed": 1, "max_new_tokens": 3, "temperature": 0.0})
            return [e async for e in deployment.backend.speech(spec)]

        audio = pcm_to_array(asyncio.run(run()))
    finally:
        deployment.close()
    assert audio.size > 0 and audio.size % SAMPLES_PER_TOKEN == 0 and np.isfinite(audio).all()
    assert audio.size <= (3 + 3) * SAMPLES_PER_TOKEN  # Turbo appends three silence tokens
