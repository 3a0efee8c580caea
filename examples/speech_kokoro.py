"""Kokoro-82M: a voice, a blend of two voices at another speed, and the same text streamed
sentence by sentence as raw PCM (24 kHz, 16-bit mono). Phonemes may be sent instead of text.

    mstar serve kokoro           # hexgrad/Kokoro-82M from the HF cache; CPU is fine
    python examples/speech_kokoro.py [out.wav]

English text needs the misaki G2P (``pip install -e '.[kokoro]'``); ``phonemes`` skip it.
See docs/kokoro.md for the voices, ``lang_code`` and the knobs.
"""

import sys

import httpx
import openai
from _common import BASE_URL, model_name

MODEL = model_name("kokoro")
out = sys.argv[1] if len(sys.argv) > 1 else "kokoro.wav"
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
text = "Hello from M star. Kokoro speaks this sentence. And then this one."

voices = httpx.get(f"{BASE_URL}/v1/audio/voices", params={"model": MODEL}).json()["voices"]
print(f"{len(voices)} voices, e.g. {', '.join(v['voice_id'] for v in voices[:4])}")

client.audio.speech.create(model=MODEL, voice="af_heart", input=text, response_format="wav").write_to_file(out)
print(f"wrote {out}")

blend = client.audio.speech.create(model=MODEL, voice="af_bella(2)+af_sky(1)", input=text, speed=1.25,
                                   response_format="pcm")
print(f"blend at 1.25x: {len(blend.content) // 2} samples")

phonemes = client.audio.speech.create(model=MODEL, voice="af_heart", input="-", response_format="pcm",
                                      extra_body={"phonemes": "həlˈoʊ wˈɜːld."})
print(f"from phonemes: {len(phonemes.content) // 2} samples")

pcm = bytearray()
with client.audio.speech.with_streaming_response.create(model=MODEL, voice="af_heart", input=text,
                                                        response_format="pcm", extra_body={"stream": True}) as r:
    for piece in r.iter_bytes():
        pcm += piece  # play it as it comes
print(f"streamed {len(pcm) // 2} samples")
