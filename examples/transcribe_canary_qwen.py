"""Canary-Qwen 2.5B (English): a FastConformer encoder feeding Qwen3-1.7B. Transcribe a clip,
then again with an ``instruction`` of your own in place of the trained one.

    mstar serve canary_qwen      # nvidia/canary-qwen-2.5b + Qwen/Qwen3-1.7B from the HF cache; a GPU is best
    python examples/transcribe_canary_qwen.py clip.wav

The OpenAI ``prompt`` field is ignored; ``instruction`` goes in the ``model_kwargs`` form field.
"""

import json
import sys

import openai
from _common import BASE_URL, model_name

MODEL = model_name("canary_qwen")
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
with open(sys.argv[1], "rb") as clip:
    print(client.audio.transcriptions.create(model=MODEL, file=clip, language="en").text)
with open(sys.argv[1], "rb") as clip:
    shouted = client.audio.transcriptions.create(
        model=MODEL, file=clip,
        extra_body={"model_kwargs": json.dumps({"instruction": "Transcribe the following in capital letters:"})})
print(shouted.text)
