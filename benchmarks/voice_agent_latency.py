"""The voice agent's latency as a user hears it: a spoken question over the Realtime API.

``mstar serve voice_agent`` (the embedded whisper_base -> smollm2 -> piper, CPU, no download;
one worker, or ``--config configs/voice_agent.yaml`` for a worker per part) in a subprocess;
the official ``openai`` client's ``realtime.connect`` sends ``tests/data/question_24k.wav``
("What is the capital of France?", espeak-ng, then half a second of silence) as 40 ms
``input_audio_buffer.append`` chunks at the pace of real time, with server VAD at its defaults
(a turn ends after 500 ms of silence). Per run, measured on the client's clock:

* ``turn_end_to_first_audio``: from ``input_audio_buffer.speech_stopped`` (the server has
  decided the user's turn is over) to the first ``response.output_audio.delta``: what a user
  waits for, ASR, LLM prefill and first sentence, and its synthesis included;
* ``sent_to_first_audio``: from the last chunk sent to the first audio delta;
* ``turn_end_to_transcript``: to ``...input_audio_transcription.completed``;
* ``reply_done``: from ``speech_stopped`` to ``response.done``.

The reply's audio (24 kHz PCM16) is transcribed by the same server's ``whisper_base``; the
record keeps both transcripts. Each figure is the median over ``--runs`` runs (a fresh
session each, the first run a warm-up that is reported but not counted).

    python benchmarks/voice_agent_latency.py --runs 5
    python benchmarks/voice_agent_latency.py --config configs/voice_agent.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import soundfile as sf
import yaml

from benchmarks.common import Metric, ServerProcess, hardware, package_version, setup_logging, write_record

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ROOT / "tests" / "data" / "question_24k.wav"
CHUNK_S = 0.04


async def one_turn(url: str, pcm: np.ndarray) -> dict[str, Any]:
    """One session: the question spoken in real time, the reply heard; client-side timings."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
    marks: dict[str, float] = {}
    transcript, heard, audio = "", "", bytearray()
    async with client.realtime.connect(model="voice_agent") as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                           "audio": {"input": {"turn_detection": {"type": "server_vad"}}}})

        async def send() -> None:
            step = int(24000 * CHUNK_S)
            start = time.perf_counter()
            for i in range(0, len(pcm), step):
                chunk = pcm[i:i + step].astype("<i2").tobytes()
                await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
                await asyncio.sleep(max(0.0, start + (i + step) / 24000 - time.perf_counter()))
            marks["sent"] = time.perf_counter()

        sender = asyncio.create_task(send())
        async for event in conn:
            now = time.perf_counter()
            kind = event.type
            if kind == "input_audio_buffer.speech_stopped":
                marks.setdefault("speech_stopped", now)
            elif kind == "conversation.item.input_audio_transcription.completed":
                marks.setdefault("transcript", now)
                heard = event.transcript
            elif kind == "response.output_audio.delta":
                marks.setdefault("first_audio", now)
                audio += base64.b64decode(event.delta)
            elif kind == "response.output_audio_transcript.delta":
                transcript += event.delta
            elif kind == "error":
                raise RuntimeError(f"server error: {event.error}")
            elif kind == "response.done":
                marks["done"] = now
                break
        await sender
    stopped = marks["speech_stopped"]
    return {"heard": heard, "reply": transcript, "reply_audio_s": len(audio) / 2 / 24000, "audio": bytes(audio),
            "turn_end_to_first_audio_s": marks["first_audio"] - stopped,
            "sent_to_first_audio_s": marks["first_audio"] - marks["sent"],
            "turn_end_to_transcript_s": marks["transcript"] - stopped,
            "reply_done_s": marks["done"] - stopped}


def transcribe(url: str, pcm16: bytes) -> str:
    from openai import OpenAI

    wav = io.BytesIO()
    sf.write(wav, np.frombuffer(pcm16, "<i2"), 24000, format="WAV", subtype="PCM_16")
    wav.seek(0)
    return OpenAI(base_url=f"{url}/v1", api_key="none").audio.transcriptions.create(
        model="whisper_base", file=("reply.wav", wav, "audio/wav")).text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs after one warm-up")
    parser.add_argument("--config", type=Path, help="a voice_agent YAML (default: one worker, defaults)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    setup_logging(args.verbose)
    config = yaml.safe_load(args.config.read_text()) if args.config else {"device": "cpu"}
    pcm, rate = sf.read(QUESTION, dtype="int16")
    assert rate == 24000
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess("voice_agent", config, Path(tmp))
        try:
            runs = [asyncio.run(one_turn(server.url, pcm)) for _ in range(args.runs + 1)]
            reply_heard = transcribe(server.url, runs[-1]["audio"])
        finally:
            server.close()
    for i, run in enumerate(runs):
        print(f"run {i}{' (warm-up)' if i == 0 else ''}: heard {run['heard']!r}, replied {run['reply']!r}; "
              f"turn end -> first audio {run['turn_end_to_first_audio_s'] * 1000:.0f} ms", file=sys.stderr)
    timed = runs[1:]
    metrics = [Metric("voice_agent realtime", key.removesuffix("_s"), "ms", "lower",
                      ours=statistics.median(r[key] for r in timed) * 1000,
                      notes={"target_ms": 1500} if key == "turn_end_to_first_audio_s" else {})
               for key in ("turn_end_to_first_audio_s", "sent_to_first_audio_s", "turn_end_to_transcript_s",
                           "reply_done_s")]
    write_record("voice_agent_latency", {
        "hardware": hardware(), "config": config, "runs": [{k: v for k, v in r.items() if k != "audio"} for r in runs],
        "reply_as_heard_by_whisper_base": reply_heard, "openai": package_version("openai"), "metrics": metrics})
    print(f"the last reply, transcribed back: {reply_heard!r}")


if __name__ == "__main__":
    main()
