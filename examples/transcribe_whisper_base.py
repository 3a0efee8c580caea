"""Transcribe a clip with whisper_base (on the CPU, no download), as text and with segment
timestamps.

    mstar serve whisper_base     # in another shell
    python examples/transcribe_whisper_base.py clip.wav
"""

import sys

import openai
from _common import BASE_URL, model_name

MODEL = model_name("whisper_base")

client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
with open(sys.argv[1], "rb") as clip:
    text = client.audio.transcriptions.create(model=MODEL, file=clip, language="en")
print(text.text)
with open(sys.argv[1], "rb") as clip:
    verbose = client.audio.transcriptions.create(model=MODEL, file=clip, response_format="verbose_json")
for segment in verbose.segments or []:
    print(f"[{segment.start:6.2f} - {segment.end:6.2f}] {segment.text}")
