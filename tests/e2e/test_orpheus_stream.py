"""Orpheus through the in-process runtime on a tiny dummy-weight talker and SNAC: audio
streams while the talker is still talking, colocated and split over two ranks."""

import asyncio
import json
import time

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mstar.config import parse_config
from mstar.contract import RequestError, SpeechSpec
from mstar.model.orpheus import engine as talk
from mstar.model.orpheus.model import pcm_to_array
from mstar.model.snac import SnacConfig, SnacDecoder, codes_from_orpheus
from mstar.model.weights import init_dummy_weights
from mstar.runtime.launch import start

SNAC = {"encoder_dim": 8, "decoder_dim": 32, "codebook_size": 4096}
FRAMES = 9


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("orpheus-tiny")
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 156940, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 1024, "tie_word_embeddings": True,
              "bos_token_id": 128000, "eos_token_id": talk.END_OF_SPEECH}
    (path / "config.json").write_text(json.dumps(config))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    return path


def scripted_codes(request_index: int) -> list[int]:
    rng = np.random.default_rng(request_index)
    return rng.integers(0, 4096, FRAMES * 7).tolist()


def script_talker(engine, slow: float = 0.0):
    """Make the dummy talker say a fixed code sequence per request, then stop."""
    said: dict[str, int] = {}

    def choose(logits, seqs, sample, lead=0):
        out = []
        for seq in seqs:
            rid = seq.request_id
            k = said.get(rid, 0)
            said[rid] = k + 1
            codes = scripted_codes(int(rid.split("#")[0].split("-")[-1]))  # "#n": an id used again
            if k == 0:
                out.append(talk.START_OF_SPEECH)
            elif k - 1 < len(codes):
                i = k - 1
                out.append(talk.AUDIO_BASE + (i % 7) * 4096 + codes[i])
            else:
                out.append(talk.END_OF_SPEECH)
        time.sleep(slow)
        EVENTS.append(("talk", len(seqs)))
        return torch.tensor(out, device=logits.device)

    engine.rules.choose = choose


EVENTS: list[tuple[str, int]] = []


def deploy(model_dir, two_ranks: bool, **extra):
    groups = [{"node_names": ["llm"], "ranks": [0]}, {"node_names": ["snac_decoder"], "ranks": [1 if two_ranks else 0]}]
    config = parse_config({"model": "orpheus", "model_path": str(model_dir), "load_format": "dummy",
                           "max_seq_len": 512, "node_groups": groups, "model_kwargs": {"snac_config": SNAC},
                           "resources": {"kv_cache": {"max_num_pages": 256, "page_size": 16}}, **extra})
    d = start(config, in_process=True)
    script_talker(d.runtime.workers.workers[0].engines["llm"], slow=0.005)
    return d


@pytest.fixture(scope="module", params=["colocated", "two_ranks"])
def deployment(request, model_dir):
    d = deploy(model_dir, request.param == "two_ranks")
    yield d
    d.close()


def speak(d, rid, text="Hello there", voice="tara", close_after=None):
    async def go():
        events = []
        it = d.backend.speech(SpeechSpec(rid, text, voice))
        async for event in it:
            events.append(event)
            if close_after is not None and len(events) >= close_after:
                await it.aclose()
                break
        return events

    return asyncio.run(go())


def reference_audio(index: int) -> np.ndarray:
    decoder = SnacDecoder(SnacConfig.from_dict(SNAC))
    init_dummy_weights(decoder, seed=1)
    with torch.inference_mode():
        return decoder.decode(codes_from_orpheus(scripted_codes(index)), noise=False)[0, 0].numpy()


def test_streamed_audio_equals_whole_decode(deployment):
    events = speak(deployment, "req-1")
    audio = pcm_to_array(events)
    whole = reference_audio(1)
    assert audio.shape == whole.shape == (FRAMES * 2048,)
    assert len([e for e in events if e.data]) >= FRAMES - 3  # one chunk per frame after the first window
    error = np.abs(audio - whole).max() / np.abs(whole).max()
    assert error < 0.1, error  # windows see 1 frame before and 2 after, not the whole utterance


def test_a_request_id_used_again_speaks_again(deployment):
    """A caller may reuse an id once its request ended: the workers still remember the old
    one's release (they drop its late inputs), so the runtime runs the new one under an id
    of its own, and it speaks at once instead of waiting out the input timeout."""
    first = pcm_to_array(speak(deployment, "again-1"))
    start = time.monotonic()
    second = pcm_to_array(speak(deployment, "again-1"))
    assert time.monotonic() - start < 30
    assert second.shape == first.shape and np.array_equal(first, second)


def test_first_audio_reaches_frontend_before_talker_finishes(deployment):
    EVENTS.clear()
    spec = deployment.spec
    original = spec.output_stream

    def logging_stream(request, stop):
        stream = original(request, stop)
        feed = stream.feed

        def logged(modality, value):
            EVENTS.append(("audio", int(value.numel())))
            return feed(modality, value)

        stream.feed = logged
        return stream

    spec.output_stream = logging_stream
    try:
        speak(deployment, "req-2")
    finally:
        spec.output_stream = original
    first_audio = next(i for i, e in enumerate(EVENTS) if e[0] == "audio")
    last_talk = max(i for i, e in enumerate(EVENTS) if e[0] == "talk")
    assert first_audio < last_talk


def test_two_partitions_give_the_same_audio_as_one(model_dir):
    outs = []
    for two in (False, True):
        d = deploy(model_dir, two)
        try:
            outs.append(pcm_to_array(speak(d, "req-3")))
        finally:
            d.close()
    np.testing.assert_array_equal(outs[0], outs[1])


def test_paced_streams_sit_out_steps_and_speak_the_same(model_dir):
    """Streaming-aware scheduling: with a small buffer target and one stream stepped per tick,
    streams ahead of playback sit out steps (the talker makes audio faster than it plays),
    and every request still speaks exactly its audio, concurrently."""
    d = deploy(model_dir, False, stream_pacing={"ahead_s": 0.05, "max_streams": 1})
    try:
        async def three():
            async def one(rid):
                return [e async for e in d.backend.speech(SpeechSpec(rid, "Hello there", "tara"))]
            return await asyncio.gather(*(one(f"pace-{i}") for i in (6, 7, 8)))

        results = asyncio.run(three())
        for i, events in zip((6, 7, 8), results):
            audio, whole = pcm_to_array(events), reference_audio(i)
            assert audio.shape == whole.shape
            assert np.abs(audio - whole).max() / np.abs(whole).max() < 0.1
        conductor = d.runtime.conductor
        assert conductor.paced_holds > 0 and not conductor.paces
    finally:
        d.close()


def test_disconnect_frees_pages_and_stream_state(deployment):
    events = speak(deployment, "req-4", close_after=1)
    assert len(events) == 1
    workers = deployment.runtime.workers.workers
    engine = workers[0].engines["llm"]

    def held():  # pages, sequences, and stream items in any rank's store (the codec's rank too)
        return engine.pool.num_used_pages or engine.seqs or any(len(w.store) for w in workers.values())

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and held():
        speak(deployment, "req-5")  # later plans carry the release, to each rank in its own time
    assert engine.pool.num_used_pages == 0 and not engine.seqs
    for worker in workers.values():
        assert len(worker.store) == 0


@pytest.mark.parametrize("spec, field", [
    (SpeechSpec("e-1", "   "), "input"),
    (SpeechSpec("e-2", "hi", voice="nobody"), "voice"),
    (SpeechSpec("e-3", "hi", speed=2.0), "speed"),
    (SpeechSpec("e-4", "x" * 5000), "input"),
    (SpeechSpec("e-5", "hi", model_kwargs={"temperature": -1}), "model_kwargs"),
])
def test_bad_requests_name_the_field(deployment, spec, field):
    with pytest.raises(RequestError) as err:
        asyncio.run(deployment.backend.speech(spec).__anext__())
    assert err.value.field == field
