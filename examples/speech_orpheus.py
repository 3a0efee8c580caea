"""Orpheus 3B TTS (a Llama talker writing SNAC codes, decoded to 24 kHz): a WAV in one of its
eight voices, then the same text streamed as PCM while it is written.

    mstar serve orpheus          # canopylabs/orpheus-3b-0.1-ft + hubertsiuzdak/snac_24khz; a GPU
    python examples/speech_orpheus.py [out.wav]

Voices: tara, leah, jess, leo, dan, mia, zac, zoe. Sampling fields (``temperature``,
``top_p``, ``repetition_penalty``, ``seed``, ``max_tokens``) go in ``extra_body``.
"""

import sys

import openai
from _common import BASE_URL, model_name

MODEL = model_name("orpheus")
out = sys.argv[1] if len(sys.argv) > 1 else "orpheus.wav"
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
text = "Hey there, this is Orpheus speaking through M star."

speech = client.audio.speech.create(model=MODEL, voice="tara", input=text, response_format="wav",
                                    extra_body={"temperature": 0.6, "repetition_penalty": 1.1, "seed": 7})
speech.write_to_file(out)
print(f"wrote {out}")

pcm = bytearray()
with client.audio.speech.with_streaming_response.create(model=MODEL, voice="leo", input=text,
                                                        response_format="pcm",
                                                        extra_body={"stream": True, "seed": 7}) as r:
    for piece in r.iter_bytes():
        pcm += piece  # 16-bit mono at 24 kHz: play it as it comes
print(f"streamed {len(pcm) // 2} samples")
