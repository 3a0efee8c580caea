"""A Kokoro deployment on real-layout weights (a tiny checkpoint written by the reference
``kokoro.KModel`` into a hub cache: config.json, kokoro-v1_0.pth, voices/*.pt), in process:
what the served walk speaks equals ``KModel.forward_with_tokens`` on the same ids, voice row,
speed and noise seed (kokoro==0.9.4, fp32 CPU, within 1e-4 of peak)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from mstar.config import parse_config
from mstar.contract import SpeechSpec
from mstar.model.speech_output import pcm_to_array
from mstar.runtime.launch import start
from tests.support.kokoro import TINY_CONFIG, hub_snapshot, reference_model, voice_table, write_checkpoint

pytest.importorskip("kokoro", reason="the reference: pip install kokoro==0.9.4")

PHONEMES = "ðə kˈæt sˈæt ˈɔn ðə mˈæt"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    reference = reference_model(cache, seed=5)
    write_checkpoint(hub_snapshot(cache), reference, voices=("af_one", "bm_two"))
    config = parse_config({"model": "kokoro", "model_path": "hexgrad/Kokoro-82M", "cache_dir": str(cache),
                           "device": "cpu", "node_groups": [{"node_names": ["kokoro"], "ranks": [0]}]})
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    deployment = start(config, in_process=True)
    try:
        yield deployment, reference
    finally:
        deployment.close()
        mp.undo()


def speak(deployment, spec: SpeechSpec) -> np.ndarray:
    async def run():
        return [e async for e in deployment.backend.speech(spec)]

    return pcm_to_array(asyncio.run(run()))


@pytest.mark.parametrize(("voice", "speed"), [("af_one", 1.0), ("bm_two", 1.4), ("af_one(1)+bm_two(3)", 0.9)])
def test_served_audio_is_the_reference_forward(served, voice: str, speed: float):
    deployment, reference = served
    assert deployment.backend.voices() == ["af_one", "bm_two"]
    got = speak(deployment, SpeechSpec(f"k-{voice}-{speed}", "-", voice, speed, {"phonemes": PHONEMES}))
    ids = [TINY_CONFIG["vocab"][p] for p in PHONEMES if p in TINY_CONFIG["vocab"]]
    tables = {"af_one": voice_table(100), "bm_two": voice_table(101)}
    table = {"af_one": tables["af_one"], "bm_two": tables["bm_two"],
             "af_one(1)+bm_two(3)": 0.25 * tables["af_one"] + 0.75 * tables["bm_two"]}[voice]
    torch.manual_seed(0)  # request seed 0, chunk 0
    want, _ = reference.forward_with_tokens(torch.tensor([[0, *ids, 0]]), table[len(ids) - 1], speed)
    assert got.shape == tuple(want.shape)
    assert np.abs(got - want.numpy()).max() / np.abs(want.numpy()).max() <= 1e-4
