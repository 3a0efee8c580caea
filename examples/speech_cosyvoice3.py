"""Fun-CosyVoice3 0.5B always speaks in a cloned voice: a clip and what it says. A WAV in that
voice, the same with a style instruction, then streamed as PCM.

    mstar serve cosyvoice3       # FunAudioLLM/Fun-CosyVoice3-0.5B-2512; pip install -e '.[cosyvoice3]'; a GPU is best
    python examples/speech_cosyvoice3.py clip.wav "what the clip says" [out.wav] ["what to say"]

A deployment with ``model_kwargs.voices_dir`` also has preset voices (``<name>.wav`` +
``<name>.txt``), named in ``voice`` instead of a clip; see docs/cosyvoice3.md.
"""

import base64
import sys

import openai
from _common import BASE_URL, model_name

MODEL = model_name("cosyvoice3")
clip_path, clip_text = sys.argv[1], sys.argv[2]
out = sys.argv[3] if len(sys.argv) > 3 else "cosyvoice3.wav"
text = sys.argv[4] if len(sys.argv) > 4 else "This voice was cloned from a few seconds of speech."
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
with open(clip_path, "rb") as f:
    voice = {"ref_audio": "data:audio/wav;base64," + base64.b64encode(f.read()).decode(), "ref_text": clip_text}

client.audio.speech.create(model=MODEL, voice="clone", input=text, response_format="wav",
                           extra_body={**voice, "seed": 5}).write_to_file(out)
print(f"wrote {out}")

styled = client.audio.speech.create(model=MODEL, voice="clone", input=text, response_format="pcm",
                                    instructions="Speak slowly and calmly.", extra_body={**voice, "seed": 5})
print(f"with an instruction: {len(styled.content) // 2} samples")

pcm = bytearray()
with client.audio.speech.with_streaming_response.create(model=MODEL, voice="clone", input=text,
                                                        response_format="pcm",
                                                        extra_body={**voice, "stream": True, "seed": 5}) as r:
    for piece in r.iter_bytes():
        pcm += piece  # 16-bit mono at 24 kHz: play it as it comes
print(f"streamed {len(pcm) // 2} samples")
