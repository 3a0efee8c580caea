"""Transcribe with NVIDIA's transducers: ``parakeet`` (Parakeet TDT 0.6B v3, 25 European
languages, detected) or ``nemotron_asr`` (``MSTAR_MODEL=nemotron_asr``; a language prompt),
through the OpenAI route and then through M*'s own ``/generate``.

    mstar serve parakeet         # nvidia/parakeet-tdt-0.6b-v3 from the HF cache; CPU or GPU
    python examples/transcribe_parakeet.py clip.wav

Decoding is greedy (no ``temperature``) and there are no timestamps; see docs/fastconformer.md.
"""

import sys

import httpx
import openai
from _common import BASE_URL, model_name

MODEL = model_name("parakeet")
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
with open(sys.argv[1], "rb") as clip:
    print(client.audio.transcriptions.create(model=MODEL, file=clip, language="en").text)

# The native route: multipart ``files`` and ``text``, one JSON result (NDJSON with streaming=true).
with open(sys.argv[1], "rb") as clip:
    reply = httpx.post(f"{BASE_URL}/generate", files={"files": ("clip.wav", clip, "audio/wav")},
                       data={"text": ""}, timeout=300)  # /generate serves the one model
reply.raise_for_status()
print(reply.json()["text"])
