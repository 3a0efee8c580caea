"""Kokoro over HTTP: a real ``mstar serve kokoro`` on a small dummy-weight deployment (Kokoro's
fixed widths, a tiny PL-BERT and generator), one server for the file, driven by the official
``openai`` client: phoneme input, voices and blends, speed, streaming sentence by sentence,
concurrent requests equal to their solo audio (within float rounding), and 4xx for bad input."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from live_server import launch_server

from mstar import MStarClient
from mstar.model.kokoro.phonemes import installed

TINY = {"n_layer": 1, "max_dur": 4, "text_encoder_kernel_size": 3,
        "plbert": {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64, "num_hidden_layers": 2},
        "istftnet": {"upsample_kernel_sizes": [4, 4], "upsample_rates": [2, 2], "gen_istft_hop_size": 2,
                     "gen_istft_n_fft": 8, "resblock_dilation_sizes": [[1, 3, 5]], "resblock_kernel_sizes": [3],
                     "upsample_initial_channel": 512}}
SAMPLES_PER_FRAME = 16  # 2 * (2 * 2) * 2: the decoder doubles the frames, two x2 stages, hop 2
HELLO = "həlˈoʊ wˈɜːld."
SENTENCES = "həlˈoʊ wˈɜːld. ðɪs ɪz ə tˈɛst. ænd ə θˈɜːd sˈɛntəns ɪz hˈɪɹ."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("kokoro")
    config = {"model": "kokoro", "load_format": "dummy", "device": "cpu", "max_concurrent_requests": 8,
              "node_groups": [{"node_names": ["kokoro"], "ranks": [0]}],
              "model_kwargs": {"dummy_config": TINY, "first_chunk_target_phonemes": 16,
                               "chunk_target_phonemes": 24}}
    (work / "kokoro.yaml").write_text(json.dumps(config))  # JSON is YAML
    with launch_server("kokoro", work, ["--config", str(work / "kokoro.yaml")]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def speak(client, phonemes: str = HELLO, voice: str = "af_heart", speed: float = 1.0, **extra) -> np.ndarray:
    audio = client.audio.speech.create(model="kokoro", voice=voice, input="-", speed=speed, response_format="pcm",
                                       extra_body={"phonemes": phonemes, "seed": 3, **extra})
    return np.frombuffer(audio.content, "<i2")


def test_wav_at_24khz_whole_frames(client):
    audio = client.audio.speech.create(model="kokoro", voice="af_heart", input="-", response_format="wav",
                                       extra_body={"phonemes": HELLO})
    samples, rate = sf.read(io.BytesIO(audio.content))
    assert rate == 24000 and samples.ndim == 1 and len(samples) > 0
    assert len(samples) % SAMPLES_PER_FRAME == 0


def test_streamed_sentences_join_to_the_whole(client):
    whole = speak(client, SENTENCES)
    with client.audio.speech.with_streaming_response.create(
            model="kokoro", voice="af_heart", input="-", response_format="pcm",
            extra_body={"phonemes": SENTENCES, "seed": 3, "stream": True}) as response:
        pieces = list(response.iter_bytes())
    assert np.array_equal(np.frombuffer(b"".join(pieces), "<i2"), whole)


def test_speed_blends_and_voices(client, server):
    base = speak(client)
    assert len(speak(client, speed=2.0)) < len(base) < len(speak(client, speed=0.5))
    blend = speak(client, voice="af_bella+af_sky")
    assert not np.array_equal(blend, speak(client, voice="af_bella"))
    assert np.array_equal(speak(client, voice="af_bella(1)+af_sky(1)"), blend)
    assert np.array_equal(speak(client), base)  # seeded: the same audio again
    voices = httpx.get(f"{server.url}/v1/audio/voices").json()["voices"]
    assert {"af_heart", "bm_george"} <= {v["voice_id"] for v in voices}


def test_concurrent_requests_equal_their_solo_audio(client):
    texts = [HELLO, SENTENCES, "ðə kˈæt sˈæt.", HELLO + " " + HELLO, "ə.", SENTENCES[:30], "tˈɛst.", HELLO]
    voices = ["af_heart", "am_adam", "bf_emma", "af_bella+af_sky", "bm_george", "af_sky", "am_echo", "af_nova"]
    solo = [speak(client, t, v) for t, v in zip(texts, voices)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda tv: speak(client, *tv), zip(texts, voices)))
    for one, alone in zip(together, solo):
        # same durations (length); samples within float rounding of a batched matmul: 1e-4 of
        # full scale (the PCM16 quantisation step is 3e-5)
        assert one.shape == alone.shape
        assert np.abs(one.astype(np.int32) - alone).max() <= 3, np.abs(one.astype(np.int32) - alone).max()


def test_sdk_tts_with_a_blend_speed_and_phonemes(client, server, tmp_path):
    result = MStarClient(server.url).tts("-", voice="af_bella+af_sky", response_format="pcm", speed=1.5,
                                         phonemes=HELLO, seed=3)
    assert result.sample_rate == 24000
    assert np.array_equal(np.frombuffer(result.audio, "<i2"), speak(client, voice="af_bella+af_sky", speed=1.5))


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"voice": "zz_nobody"}, "voice", "unknown voice 'zz_nobody'"),
    ({"voice": "af_bella+"}, "voice", "is not a voice or a blend"),
    ({"speed": 5.0}, "speed", "less than or equal to 4"),
    ({"extra_body": {"phonemes": "123"}}, "phonemes", "no phoneme Kokoro can speak"),
    ({"extra_body": {"temperature": 0.5, "phonemes": HELLO}}, "model_kwargs", "temperature"),
    ({"extra_body": {"lang_code": "q", "phonemes": HELLO}}, "lang_code", ""),
])
def test_bad_input_is_a_400_naming_the_field(client, body, param, words):
    kwargs = {"model": "kokoro", "voice": "af_heart", "input": "-"} | body
    kwargs.setdefault("extra_body", {"phonemes": HELLO})
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(**kwargs)
    assert param in err.value.message and words in err.value.message


@pytest.mark.skipif(installed("a"), reason="misaki's English G2P is installed here")
def test_text_without_g2p_names_input_and_the_install_hint(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(model="kokoro", voice="af_heart", input="Hello world.")
    assert "input" in err.value.message and "mstar-ai[kokoro]" in err.value.message


def test_voices_list_their_language_and_a_clip_is_refused(client, server):
    voices = {v["voice_id"]: v for v in httpx.get(f"{server.url}/v1/audio/voices").json()["voices"]}
    assert voices["af_heart"] == {"voice_id": "af_heart", "name": "af_heart", "model": "kokoro", "language": "en-US",
                                  "source": "bundled"}
    assert voices["bm_george"]["language"] == "en-GB"
    with pytest.raises(openai.BadRequestError) as err:
        speak(client, ref_audio="UklGRg==")
    assert err.value.body["param"] == "ref_audio" and "does not support voice cloning" in err.value.message


def test_sentence_chunking_off_is_one_synthesis(client):
    chunked, whole = speak(client, SENTENCES), speak(client, SENTENCES, sentence_chunking=False)
    assert len(whole) > 0 and not np.array_equal(whole, chunked)  # one chunk, not three
    with client.audio.speech.with_streaming_response.create(
            model="kokoro", voice="af_heart", input="-", response_format="pcm",
            extra_body={"phonemes": SENTENCES, "seed": 3, "stream": True, "sentence_chunking": False}) as response:
        assert np.array_equal(np.frombuffer(b"".join(response.iter_bytes()), "<i2"), whole)
