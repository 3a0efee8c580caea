"""Canary 1B v2: transcribe a clip, then translate it: an English clip to German, a clip in
another language to English. Translation is ``target_language`` among the ``model_kwargs``
(to or from English; ``/v1/audio/translations`` is the same to English).

    mstar serve canary           # nvidia/canary-1b-v2 from the HF cache; CPU or GPU
    python examples/transcribe_canary.py clip.wav [LANG]

``LANG`` is the clip's language (default ``en``, one of Canary's 25); see docs/fastconformer.md.
"""

import json
import sys

import openai
from _common import BASE_URL, model_name

MODEL = model_name("canary")
path, language = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "en"
target = "de" if language == "en" else "en"
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")

with open(path, "rb") as clip:
    print(client.audio.transcriptions.create(model=MODEL, file=clip, language=language).text)
with open(path, "rb") as clip:
    translated = client.audio.transcriptions.create(
        model=MODEL, file=clip, language=language,
        extra_body={"model_kwargs": json.dumps({"target_language": target})})
print(f"[{target}] {translated.text}")
