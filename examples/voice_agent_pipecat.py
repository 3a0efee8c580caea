"""One voice-agent turn through a Pipecat pipeline whose OpenAI STT, LLM and TTS services all
point at ``mstar serve voice_agent``. Headless: no transport, no microphone. A WAV file's audio
goes in as the frames a transport would push (speech started, the audio, speech stopped);
the reply's audio frames are collected into a WAV file.

    mstar serve voice_agent      # in another shell (needs: pip install -e '.[piper]')
    pip install 'pipecat-ai[openai]'         # a venv of its own will do: it only talks HTTP
    python examples/voice_agent_pipecat.py question.wav [reply.wav]

Two settings make Pipecat's OpenAI TTS fit Piper: it only sends OpenAI's voice names, so
``joe`` is added to the ones it knows; and it reads ``response_format="pcm"`` as raw samples
at whatever rate it is told, so it is told Piper's 22,050 Hz (the Joe voice's rate; other
Piper voices have their own, see ``GET /v1/audio/voices`` and docs/piper.md).
"""

import asyncio
import os
import sys
import wave

from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InputAudioRawFrame,
    LLMContextFrame,
    LLMTextFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai import tts as openai_tts
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.services.openai.stt import OpenAISTTService
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.workers.runner import WorkerRunner

BASE_URL = os.environ.get("MSTAR_BASE_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1"
MODEL = os.environ.get("MSTAR_MODEL") or "voice_agent"
VOICE, VOICE_RATE = "joe", 22050
CHUNK_MS = 20

openai_tts.VALID_VOICES[VOICE] = VOICE  # Pipecat checks voices against OpenAI's list


class AskTheLLM(FrameProcessor):
    """What a user context aggregator does, cut to one turn: the transcript becomes the
    user's message and the context goes on to the LLM."""

    def __init__(self, context: LLMContext) -> None:
        super().__init__()
        self.context = context

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            print(f"user: {frame.text.strip()}")
            self.context.add_message({"role": "user", "content": frame.text})
            await self.push_frame(LLMContextFrame(self.context), direction)
        else:
            await self.push_frame(frame, direction)


class Collect(FrameProcessor):
    """A tap that keeps the reply's text (after the LLM) or the speech's samples (after the
    TTS, which consumes the text frames) and passes every frame on."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.pcm, self.rate = "", bytearray(), VOICE_RATE

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, LLMTextFrame):
            self.text += frame.text
        elif isinstance(frame, TTSAudioRawFrame):
            self.pcm += frame.audio
            self.rate = frame.sample_rate
        await self.push_frame(frame, direction)


def read_pcm16(path: str) -> tuple[bytes, int]:
    with wave.open(path, "rb") as wav:
        if (wav.getnchannels(), wav.getsampwidth()) != (1, 2):
            sys.exit(f"{path}: need mono 16-bit PCM")
        return wav.readframes(wav.getnframes()), wav.getframerate()


async def main(question: str, out: str) -> None:
    pcm, rate = read_pcm16(question)
    context = LLMContext()
    stt = OpenAISTTService(api_key="none", base_url=BASE_URL, settings=OpenAISTTService.Settings(model=MODEL))
    llm = OpenAILLMService(api_key="none", base_url=BASE_URL,
                           settings=OpenAILLMService.Settings(
                               model=MODEL, temperature=0,
                               system_instruction="You are a helpful voice assistant. Answer in one short sentence."))
    tts = OpenAITTSService(api_key="none", base_url=BASE_URL, sample_rate=VOICE_RATE,
                           settings=OpenAITTSService.Settings(model=MODEL, voice=VOICE))
    said, heard_back = Collect(), Collect()
    worker = PipelineWorker(Pipeline([stt, AskTheLLM(context), llm, said, tts, heard_back]),
                            params=PipelineParams(audio_in_sample_rate=rate, audio_out_sample_rate=VOICE_RATE))

    step = rate * 2 * CHUNK_MS // 1000
    frames = [VADUserStartedSpeakingFrame()]
    frames += [InputAudioRawFrame(pcm[i:i + step], rate, 1) for i in range(0, len(pcm), step)]
    frames += [VADUserStoppedSpeakingFrame(), EndFrame()]  # EndFrame: finish the turn, then stop
    await worker.queue_frames(frames)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await runner.run()

    print(f"assistant: {said.text.strip()}")
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(heard_back.rate)
        wav.writeframes(bytes(heard_back.pcm))
    print(f"wrote {out}: {len(heard_back.pcm) / 2 / heard_back.rate:.2f} s at {heard_back.rate} Hz")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "reply.wav"))
