"""A spoken conversation with ``mstar serve voice_agent`` over the OpenAI Realtime API
(``/v1/realtime``, a WebSocket), with the official ``openai`` client: the server's VAD finds
the end of the question in the streamed audio, Whisper transcribes it, SmolLM2 answers and
Piper speaks the answer back as 24 kHz PCM16 while it is still being written.

    mstar serve voice_agent      # in another shell (needs: pip install -e '.[piper,realtime]')
    python examples/voice_agent_realtime.py question.wav [reply.wav]

The question is a 24 kHz mono 16-bit WAV (tests/data/question_24k.wav says "What is the
capital of France?"); it is sent in 40 ms chunks at the pace of speech, as a microphone would,
then a second of silence so the VAD sees the turn end. The reply's audio goes to a WAV file.
"""

import asyncio
import base64
import sys
import wave

import openai
from _common import BASE_URL, model_name

MODEL = model_name("voice_agent")
RATE = 24000  # the Realtime API's audio/pcm: 24 kHz mono little-endian 16-bit
CHUNK_MS = 40


def read_pcm16(path: str) -> bytes:
    """The WAV's frames, which must already be what the API takes (no resampling here)."""
    with wave.open(path, "rb") as wav:
        if (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) != (RATE, 1, 2):
            sys.exit(f"{path}: need {RATE} Hz mono 16-bit PCM")
        return wav.readframes(wav.getnframes())


async def stream_microphone_like(conn, pcm: bytes) -> None:
    """Append the audio in real time, then silence: nothing is committed by hand, the
    server's VAD decides where the turn ends."""
    step = RATE * 2 * CHUNK_MS // 1000
    for start in range(0, len(pcm) + RATE * 2, step):
        piece = pcm[start:start + step] or bytes(step)
        await conn.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        await asyncio.sleep(CHUNK_MS / 1000)


async def main(question: str, out: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
    reply = bytearray()
    async with client.realtime.connect(model=MODEL) as conn:
        await conn.session.update(session={
            "type": "realtime",
            "output_modalities": ["audio"],
            "instructions": "You are a helpful voice assistant. Answer in one short sentence.",
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": RATE},
                          "transcription": {"model": MODEL, "language": "en"},
                          "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}},
                "output": {"format": {"type": "audio/pcm", "rate": RATE}, "voice": "joe"},
            },
        })
        sender = asyncio.create_task(stream_microphone_like(conn, read_pcm16(question)))
        try:
            async for event in conn:
                if event.type == "error":
                    sys.exit(f"error: {event.error.message}")
                if event.type == "input_audio_buffer.speech_stopped":
                    print(f"[end of turn at {event.audio_end_ms} ms]")
                elif event.type == "conversation.item.input_audio_transcription.completed":
                    print(f"user: {event.transcript}")
                elif event.type == "response.output_audio_transcript.delta":
                    print(event.delta, end="", flush=True)
                elif event.type == "response.output_audio.delta":
                    reply += base64.b64decode(event.delta)  # play it here as it comes
                elif event.type == "response.done":
                    print(f"\n[{event.response.status}]")
                    break
        finally:
            sender.cancel()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(RATE)
        wav.writeframes(bytes(reply))
    print(f"wrote {out}: {len(reply) / 2 / RATE:.2f} s")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "reply.wav"))
