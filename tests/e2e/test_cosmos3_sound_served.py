"""Cosmos3 with sound behind the HTTP app on the CPU: a tiny sound-capable deployment (a
``sound_gen`` tower and a ``sound_tokenizer/``, 8 kHz stereo) with ``load_format: dummy``.
``enable_sound`` on /v1/videos/generations, the /v1/videos job API and /generate gives an mp4
with an H.264 video stream and an AAC audio stream of the clip's duration and the tokenizer's
sample rate; without it the mp4 has no audio stream."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from live_server import Uvicorn

from mstar.config import parse_config
from mstar.media.video import decode_mp4, decode_mp4_audio
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support.cosmos3_sound import SOUND

pytest.importorskip("diffusers")
pytest.importorskip("av")

MODEL = "cosmos3"
WIDTH, HEIGHT = 32, 48
RATE = 8000  # an AAC rate
AAC_FRAME = 1024


def write_tiny_sound_cosmos3(root: Path) -> Path:
    """The model tests' tiny checkpoint layout with the sound pathway, weight files removed."""
    path = Path(__file__).parents[1] / "model" / "cosmos3" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_cosmos3_tiny_sound", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from diffusers import AutoencoderKLWan, Cosmos3AVAEAudioTokenizer, Cosmos3OmniTransformer

    tok = module.tokenizer()
    tower = Cosmos3OmniTransformer(vocab_size=len(tok), **module.TOWER, sound_gen=True,
                                   sound_dim=SOUND["vocoder_input_dim"], sound_latent_fps=RATE / 12)
    module.write_checkpoint(root, tower, AutoencoderKLWan(**module.VAE), tok)
    sound = Cosmos3AVAEAudioTokenizer(**{**SOUND, "sampling_rate": RATE})
    (root / "sound_tokenizer").mkdir()
    (root / "sound_tokenizer" / "config.json").write_text(json.dumps(dict(sound.config), default=list))
    for weights in root.glob("*/*.safetensors"):
        weights.unlink()
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    root = write_tiny_sound_cosmos3(tmp_path_factory.mktemp("cosmos3-sound-tiny"))
    knobs = {"max_video_pixels": 64 * 64 * 9, "num_inference_steps": 2, "guidance_scale": 1.0}
    deployment = start(parse_config({"model": MODEL, "model_path": str(root), "load_format": "dummy",
                                     "max_concurrent_requests": 2, "model_kwargs": knobs}), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


def streams(mp4: bytes) -> tuple[int, int]:
    import av

    with av.open(io.BytesIO(mp4)) as container:
        return len(container.streams.video), len(container.streams.audio)


def check_soundtrack(mp4: bytes, frames: int, fps: int) -> None:
    assert streams(mp4) == (1, 1)
    video, rate = decode_mp4(mp4)
    assert video.shape == (frames, HEIGHT, WIDTH, 3) and rate == fps
    audio, sample_rate = decode_mp4_audio(mp4)
    assert sample_rate == RATE and audio.shape[0] == 2
    samples = int(frames / fps * RATE)  # the clip's length; AAC codes whole 1024-sample frames
    assert samples <= audio.shape[1] < samples + AAC_FRAME, (audio.shape, samples)
    assert np.abs(audio).max() > 0


def post(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/videos/generations", json={"model": MODEL, "prompt": "a cat purrs", "seed": 3,
                                                     "size": f"{WIDTH}x{HEIGHT}", **body})


def mp4_of(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    [item] = response.json()["data"]
    return base64.b64decode(item["b64_json"])


def test_enable_sound_muxes_an_aac_stream(http: httpx.Client) -> None:
    check_soundtrack(mp4_of(post(http, num_frames=9, fps=8, enable_sound=True)), 9, 8)
    check_soundtrack(mp4_of(post(http, num_frames=5, fps=4, enable_sound=True)), 5, 4)


def test_without_the_option_no_audio_stream(http: httpx.Client) -> None:
    for body in ({}, {"enable_sound": False}):
        mp4 = mp4_of(post(http, num_frames=9, fps=8, **body))
        assert streams(mp4) == (1, 0)


def test_video_job_with_sound(oai: openai.OpenAI) -> None:
    video = oai.videos.create_and_poll(model=MODEL, prompt="a cat purrs", size=f"{WIDTH}x{HEIGHT}",
                                       extra_body={"num_frames": 9, "fps": 8, "seed": 1, "enable_sound": "true"},
                                       poll_interval_ms=20)
    assert video.status == "completed", video.error
    check_soundtrack(oai.videos.download_content(video.id).read(), 9, 8)


def test_generate_returns_the_audio(server: Uvicorn) -> None:
    kwargs = {"width": WIDTH, "height": HEIGHT, "num_frames": 9, "fps": 8, "seed": 1, "enable_sound": True}
    response = httpx.post(f"{server.url}/generate", timeout=120,
                          data={"text": "a cat purrs", "output_modalities": "video,audio",
                                "model_kwargs": json.dumps(kwargs)})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    pcm = np.frombuffer(base64.b64decode(data["audio"]), dtype="<i2")
    assert pcm.size == 2 * int(9 / 8 * RATE)  # interleaved stereo, the clip's length
    assert len(base64.b64decode(data["video"])) == 9 * HEIGHT * WIDTH * 3
