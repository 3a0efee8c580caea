"""Chatterbox TTS: the built-in voice with more expression, then (given a clip) the same text
in a voice cloned from it, streamed.

    mstar serve chatterbox       # ResembleAI/chatterbox from the HF cache; a GPU is best
    python examples/speech_chatterbox.py [out.wav] [voice_clip.wav]

``MSTAR_MODEL=chatterbox_multilingual`` takes ``language_id`` (``fr``, ``de``, ...);
``chatterbox_turbo`` takes ``top_k`` and has no ``exaggeration``/``cfg_weight``
(see docs/chatterbox.md). The output is 24 kHz and carries the PerTh watermark.
"""

import base64
import sys

import openai
from _common import BASE_URL, model_name

MODEL = model_name("chatterbox")
out = sys.argv[1] if len(sys.argv) > 1 else "chatterbox.wav"
clip_path = sys.argv[2] if len(sys.argv) > 2 else None
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
text = "Chatterbox is speaking through M star."

style = {} if MODEL == "chatterbox_turbo" else {"exaggeration": 0.7, "cfg_weight": 0.4}
if MODEL == "chatterbox_multilingual":
    style["language_id"] = "en"
client.audio.speech.create(model=MODEL, voice="default", input=text, response_format="wav",
                           extra_body={**style, "seed": 1}).write_to_file(out)
print(f"wrote {out}")

if clip_path:
    with open(clip_path, "rb") as f:
        clip = "data:audio/wav;base64," + base64.b64encode(f.read()).decode()
    pcm = bytearray()
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="default", input=text, response_format="pcm",
            extra_body={"ref_audio": clip, "stream": True, "seed": 1}) as r:
        for piece in r.iter_bytes():
            pcm += piece  # 16-bit mono at 24 kHz, in the clip's voice
    print(f"cloned and streamed {len(pcm) // 2} samples")
