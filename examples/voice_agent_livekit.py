"""One voice-agent turn through LiveKit Agents' OpenAI plugin, its STT, LLM and TTS all
pointed at ``mstar serve voice_agent``. No LiveKit server, room or microphone: the plugins'
own calls (``STT.recognize``, ``LLM.chat``, ``TTS.synthesize``) run one turn from a WAV file to
a WAV file; in an ``AgentSession`` the same three objects are what you pass as
``stt=``/``llm=``/``tts=``.

    mstar serve voice_agent
    pip install 'livekit-agents[openai]'     # a venv of its own will do: it only talks HTTP
    python examples/voice_agent_livekit.py question.wav [reply.wav]

The TTS plugin asks for OpenAI's SSE speech stream (``stream_format="sse"``: base64 audio
deltas, then a done event), which M* sends. It is told to ask for WAV, so it reads Piper's
22,050 Hz from the header and resamples to its 24 kHz.
"""

import asyncio
import os
import sys
import wave

from livekit import rtc
from livekit.agents import llm
from livekit.plugins import openai as lk_openai

BASE_URL = os.environ.get("MSTAR_BASE_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1"
MODEL = os.environ.get("MSTAR_MODEL") or "voice_agent"
TTS_MODEL = os.environ.get("MSTAR_TTS_MODEL") or MODEL


def read_frame(path: str) -> rtc.AudioFrame:
    """The whole WAV (mono 16-bit) as one LiveKit frame."""
    with wave.open(path, "rb") as wav:
        if (wav.getnchannels(), wav.getsampwidth()) != (1, 2):
            sys.exit(f"{path}: need mono 16-bit PCM")
        pcm = wav.readframes(wav.getnframes())
        return rtc.AudioFrame(pcm, wav.getframerate(), 1, len(pcm) // 2)


async def main(question: str, out: str) -> None:
    stt = lk_openai.STT(model=MODEL, base_url=BASE_URL, api_key="none", language="en", use_realtime=False)
    brain = lk_openai.LLM(model=MODEL, base_url=BASE_URL, api_key="none", temperature=0)
    voice = lk_openai.TTS(model=TTS_MODEL, voice="joe", base_url=BASE_URL, api_key="none", response_format="wav")

    heard = (await stt.recognize(buffer=read_frame(question))).alternatives[0].text.strip()
    print(f"user: {heard}")

    chat = llm.ChatContext()
    chat.add_message(role="system", content="You are a helpful voice assistant. Answer in one short sentence.")
    chat.add_message(role="user", content=heard)
    reply = ""
    async with brain.chat(chat_ctx=chat) as stream:
        async for chunk in stream:
            if chunk.delta and chunk.delta.content:
                reply += chunk.delta.content
    reply = reply.strip()
    print(f"assistant: {reply}")

    frames = []
    async with voice.synthesize(reply) as stream:
        async for audio in stream:
            frames.append(audio.frame)
    spoken = rtc.combine_audio_frames(frames)
    with open(out, "wb") as wav:
        wav.write(spoken.to_wav_bytes())
    print(f"wrote {out}: {spoken.samples_per_channel / spoken.sample_rate:.2f} s at {spoken.sample_rate} Hz")
    for plugin in (stt, brain, voice):
        await plugin.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "reply.wav"))
