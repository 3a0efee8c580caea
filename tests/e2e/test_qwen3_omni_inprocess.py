"""Qwen3-Omni served through an in-process deployment, on a tiny random whole model written as a
hub-like checkpoint directory (config.json, tokenizer, released-layout safetensors), fp32 on
the CPU, greedy: the ``text`` walk's ids equal the plain thinker's (``run_thinker``) for a text
and an audio+text prompt, and for image and video prompts (an mp4 written with PyAV); the
``speech`` walk's text, codes and waveform equal ``speak``'s, its streamed chunks equal
code2wav's decode of the same cuts and the whole decode within the codec window's tolerance; a
text request never touches the talker or code2wav; concurrent requests equal their solo
results; bad input is a RequestError naming the field."""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers.models.qwen3_omni_moe")

from inprocess import deployed, poll_drained, record_batches  # noqa: E402

from mstar.audio import decode_audio  # noqa: E402
from mstar.contract import ChatSpec, GenerateSpec, OutputEvent, RequestError, SamplingParams  # noqa: E402
from mstar.graph import ScheduledChunks  # noqa: E402
from mstar.model.qwen3_omni.audio import mel_features  # noqa: E402
from mstar.model.qwen3_omni.checkpoint import Qwen3OmniCheckpoint  # noqa: E402
from mstar.model.qwen3_omni.inputs import splice_features, splice_vision  # noqa: E402
from mstar.model.qwen3_omni.speech import (  # noqa: E402
    ChatTokens,
    new_caches,
    run_talker,
    run_thinker,
    sequence_metadata,
    speak,
    special_codes,
    talker_prompt,
)
from mstar.model.speech_output import pcm_to_array  # noqa: E402
from mstar.runtime.launch import Deployment  # noqa: E402
from tests.support.qwen3_omni import (  # noqa: E402
    ACCEPT_HIDDEN_LAYER,
    AUDIO_TOKEN,
    CHAT,
    IMAGE_TOKEN,
    NEWLINE,
    VIDEO_TOKEN,
)
from tests.support.qwen3_omni_dir import (  # noqa: E402
    CHUNK,
    CONTEXT,
    MAX_FRAMES,
    SCHEDULE,
    deployment_config,
    mp4,
    wav,
    write_checkpoint,
)

TOKENS = ChatTokens(im_start=CHAT["im_start_token_id"], im_end=CHAT["im_end_token_id"], user=CHAT["user_token_id"],
                    assistant=CHAT["assistant_token_id"], tts_pad=CHAT["tts_pad_token_id"],
                    tts_bos=CHAT["tts_bos_token_id"], tts_eos=CHAT["tts_eos_token_id"], audio=AUDIO_TOKEN,
                    image=IMAGE_TOKEN, video=VIDEO_TOKEN)
EOS = [CHAT["im_end_token_id"]]
MAX_TOKENS = 6
SPEAKER = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_omni_tiny"))


@pytest.fixture(scope="module")
def deployment(checkpoint: Path) -> Iterator[Deployment]:
    with deployed(deployment_config(checkpoint)) as d:
        yield d


@pytest.fixture(scope="module")
def plain(checkpoint: Path):
    """The parts loaded straight from the directory, for the plain-torch references."""
    ckpt = Qwen3OmniCheckpoint(checkpoint)
    cpu = torch.device("cpu")
    return (ckpt.thinker(cpu, torch.float32, dummy=False, seed=0), ckpt.talker(cpu, torch.float32, dummy=False, seed=0),
            ckpt.code2wav(cpu, torch.float32, dummy=False, seed=0))


CLIP = wav(1.3, 1)


def _spec(content, tag: str, outputs=("text",), voice: str | None = SPEAKER, **kw) -> ChatSpec:
    return ChatSpec(request_id=f"{tag}-{uuid.uuid4().hex[:8]}", messages=[{"role": "user", "content": content}],
                    sampling=SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS, output_modalities=list(outputs),
                    audio={"voice": voice, "format": "pcm"} if "audio" in outputs else None, **kw)


async def _events(d: Deployment, spec: ChatSpec) -> list[OutputEvent]:
    out = []
    events = d.backend.chat(spec)
    try:
        async for event in events:
            assert event.error is None, event.error
            out.append(event)
    finally:
        await events.aclose()
    return out


def _ids(events: list[OutputEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _chunks(events: list[OutputEvent]) -> list[np.ndarray]:
    return [np.frombuffer(e.data, "<f4") for e in events if e.modality == "audio" and e.data]


def _prompt_ids(d: Deployment, content) -> list[int]:
    return d.spec.prepare_chat(_spec(content, "probe")).inputs["prompt_ids"].tolist()


def test_text_walk_equals_the_plain_thinker(deployment: Deployment, plain) -> None:
    d = deployment
    thinker = plain[0]
    text_ids = _prompt_ids(d, "hi there")
    assert text_ids[:3] == [TOKENS.im_start, TOKENS.user, NEWLINE]
    want = run_thinker(thinker.text, text_ids, MAX_TOKENS, EOS, ACCEPT_HIDDEN_LAYER).generated
    assert _ids(asyncio.run(_events(d, _spec("hi there", "text")))) == want

    content = [{"type": "text", "text": "listen:"}, {"type": "audio", "data": CLIP}]
    request = d.spec.prepare_chat(_spec(content, "probe"))
    ids = request.inputs["prompt_ids"]
    wave = torch.from_numpy(decode_audio(CLIP, max_bytes=1 << 24, max_seconds=10).samples.copy())
    mel = mel_features(wave, 16)
    assert torch.equal(request.inputs["audio_mels"], mel)
    with torch.no_grad():
        rows = thinker.audio_tower([mel])
        embeds = splice_features(thinker.text.model.embed_tokens(ids), ids, AUDIO_TOKEN, rows)
    assert int((ids == AUDIO_TOKEN).sum()) == rows[0].shape[0] > 10
    want = run_thinker(thinker.text, ids.tolist(), MAX_TOKENS, EOS, ACCEPT_HIDDEN_LAYER, prompt_embeds=embeds).generated
    assert _ids(asyncio.run(_events(d, _spec(content, "audio")))) == want


def _png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@torch.no_grad()
def _greedy_with_images(thinker, ids: torch.Tensor, embeds: torch.Tensor, patches: torch.Tensor,
                        grids: torch.Tensor, positions: torch.Tensor, steps: int) -> list[int]:
    """Plain greedy decoding of an image or video prompt (``embeds``: its input embeddings, audio
    spliced in): the vision rows and deepstack spliced in, the prompt on its 3-axis positions,
    later tokens at ``position + rope delta``."""
    text = thinker.text
    features = thinker.visual(patches, grids.tolist())
    embeds, deepstack = splice_vision(embeds, ids, thinker.visual.config, features)
    config = text.text_config
    caches = new_caches(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                        len(ids) + steps, 16, embeds)
    hidden = text(None, sequence_metadata(0, len(ids), 16, embeds.device), caches, embeds, positions, deepstack)
    token = int(text.compute_logits(hidden[-1:]).argmax())
    out, delta = [token], float(positions.max()) + 1 - positions.shape[1]
    for k in range(len(ids), len(ids) + steps - 1):
        meta = sequence_metadata(k, 1, 16, embeds.device)
        hidden = text(torch.tensor([token]), meta, caches, positions=(meta.positions + delta)[None].expand(3, -1))
        token = int(text.compute_logits(hidden).argmax())
        out.append(token)
    return out


def test_image_chat_equals_the_plain_thinker(deployment: Deployment, plain) -> None:
    d = deployment
    content = [{"type": "image", "data": _png(1, (40, 24))}, {"type": "text", "text": "and"},
               {"type": "audio", "data": CLIP}, {"type": "image", "data": _png(2, (24, 32))}]
    request = d.spec.prepare_chat(_spec(content, "probe"))
    inputs = request.inputs
    assert inputs["grid_thw"].tolist() == [[1, 6, 10], [1, 8, 6]] and inputs["positions"].shape[0] == 3
    ids = inputs["prompt_ids"]
    thinker = plain[0]
    with torch.no_grad():
        rows = thinker.audio_tower([inputs["audio_mels"]])
        embeds = splice_features(thinker.text.model.embed_tokens(ids), ids, AUDIO_TOKEN, rows)
    want = _greedy_with_images(thinker, ids, embeds, inputs["pixel_values"], inputs["grid_thw"], inputs["positions"],
                               MAX_TOKENS)
    assert _ids(asyncio.run(_events(d, _spec(content, "image")))) == want


CLIP_MP4 = mp4(10, (24, 16), 5.0, seed=4)  # 2 s at 5 fps: 4 frames kept at 2 fps, 2 groups of 4x6 patches


def test_video_chat_equals_the_plain_thinker(deployment: Deployment, plain) -> None:
    """A video between text, an image and an audio clip: 4 of its 10 frames sampled (PyAV),
    processed at 16x24, one run of 2 x 6 video pads whose temporal groups sit 25 positions apart
    (1 s a group x the config's 25 positions a second); the answer equals plain greedy decoding."""
    from mstar.media.video import decode_mp4
    from mstar.model.qwen3_omni.video import process_frames

    d = deployment
    content = [{"type": "text", "text": "watch"}, {"type": "video", "data": CLIP_MP4},
               {"type": "image", "data": _png(5, (24, 24))}, {"type": "audio", "data": CLIP}]
    inputs = d.spec.prepare_chat(_spec(content, "probe")).inputs
    assert inputs["grid_thw"].tolist() == [[2, 4, 6], [1, 6, 6]]
    frames, fps = decode_mp4(CLIP_MP4)
    assert (len(frames), fps) == (10, 5.0)
    want_patches = process_frames(frames[[0, 2, 5, 7]], d.spec.front.videos).patches  # arange(0, 10, 2.5)
    assert torch.equal(inputs["pixel_values"][:48], want_patches)
    ids = inputs["prompt_ids"]
    video = (ids == VIDEO_TOKEN).nonzero().squeeze(1)
    assert len(video) == 12 and inputs["positions"][0, video[6]] - inputs["positions"][0, video[0]] == 25
    thinker = plain[0]
    with torch.no_grad():
        rows = thinker.audio_tower([inputs["audio_mels"]])
        embeds = splice_features(thinker.text.model.embed_tokens(ids), ids, AUDIO_TOKEN, rows)
    want = _greedy_with_images(thinker, ids, embeds, inputs["pixel_values"], inputs["grid_thw"], inputs["positions"],
                               MAX_TOKENS)
    assert _ids(asyncio.run(_events(d, _spec(content, "video")))) == want


def test_video_limits_name_the_part(deployment: Deployment) -> None:
    from dataclasses import replace

    front = deployment.spec.front
    small = replace(front, knobs=front.knobs.model_copy(update={"max_video_pixels": 1000}))
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "video", "data": CLIP_MP4}]}]
    with pytest.raises(RequestError, match=r"4 sampled frames of 24x16 are 1536 pixels, over max_video_pixels") as err:
        small.split(messages)
    assert err.value.field == "messages[0].content[1]" and err.value.status == 400
    messages[0]["content"][1]["use_audio_in_video"] = True  # a silent video
    with pytest.raises(RequestError, match="use_audio_in_video needs a video with an audio track") as err:
        front.split(messages)
    assert err.value.field == "messages[0].content[1]"


SOUND_MP4 = mp4(8, (24, 16), 5.0, seed=7, sound=True)  # 1.6 s: under the deployment's 2 s of audio


def test_video_with_its_soundtrack_equals_the_plain_thinker(deployment: Deployment, plain) -> None:
    """``use_audio_in_video``: the mp4's AAC track (1.6 s: 21 audio tokens) decoded, resampled
    to 16 kHz and heard beside a plain clip; its tokens sit between the video's two frame
    groups by time (group 1 at position 25), the clips' rows spliced in prompt order."""
    d = deployment
    content = [{"type": "audio", "data": CLIP}, {"type": "text", "text": "and"},
               {"type": "video", "data": SOUND_MP4, "use_audio_in_video": True}]
    inputs = d.spec.prepare_chat(_spec(content, "probe")).inputs
    ids = inputs["prompt_ids"].tolist()
    assert inputs["audio_frames"].shape == (2,) and inputs["grid_thw"].tolist() == [[2, 4, 6]]
    start = ids.index(VIDEO_TOKEN)
    assert ids[start - 2:start] == [154, 153]  # <|vision_start|><|audio_start|>
    run = ids[start:ids.index(155, start)]
    heard = run.count(AUDIO_TOKEN)
    assert heard == 21 and run == [VIDEO_TOKEN] * 6 + [AUDIO_TOKEN] * heard + [VIDEO_TOKEN] * 6
    clip = mel_features(torch.from_numpy(decode_audio(CLIP, max_bytes=1 << 24, max_seconds=10).samples.copy()), 16)
    assert torch.equal(inputs["audio_mels"][:, :clip.shape[1]], clip)  # the plain clip first: prompt order
    ids_t = inputs["prompt_ids"]
    thinker = plain[0]
    with torch.no_grad():
        rows = thinker.audio_tower(list(inputs["audio_mels"].split(inputs["audio_frames"].tolist(), dim=1)))
        embeds = splice_features(thinker.text.model.embed_tokens(ids_t), ids_t, AUDIO_TOKEN, rows)
    want = _greedy_with_images(thinker, ids_t, embeds, inputs["pixel_values"], inputs["grid_thw"],
                               inputs["positions"], MAX_TOKENS)
    assert _ids(asyncio.run(_events(d, _spec(content, "sound")))) == want


def test_text_request_never_touches_the_talker(deployment: Deployment) -> None:
    d = deployment
    engines = d.runtime.workers.workers[0].engines
    with record_batches(engines["talker"]) as talker, record_batches(engines["code2wav"]) as codec:
        events = asyncio.run(_events(d, _spec("hello", "quiet")))
        assert _ids(events) and not _chunks(events)
        assert talker.batches == [] and codec.batches == []
        events = asyncio.run(_events(d, _spec("hello", "loud", ("text", "audio"))))
        assert _chunks(events) and talker.batches and codec.batches
    poll_drained(d, engines["thinker"], also=lambda: engines["talker"].engine.pool.num_used_pages == 0)
    assert not engines["thinker"].forward.kept and not engines["talker"].forward.prompts


def test_an_answer_too_short_to_speak_ends_in_text(deployment: Deployment) -> None:
    """One answer token leaves the talker prompt without its first text row: no frames, no
    audio, no error (the reference's ``generate`` fails there)."""
    spec = _spec("hi", "short", ("text", "audio"))
    events = asyncio.run(_events(deployment, ChatSpec(spec.request_id, spec.messages, spec.sampling, 1,
                                                      output_modalities=spec.output_modalities, audio=spec.audio)))
    assert len(_ids(events)) == 1 and not _chunks(events) and events[-1].finish_reason == "length"


def _cuts(frames: int) -> list[tuple[int, int, int]]:
    """(start, end, context) of each chunk the codec stream takes of a closed clip: its frames
    ``[start, end)``, the first ``context`` of them left context."""
    policy, out, covered, taken = ScheduledChunks(tuple(SCHEDULE), CHUNK, CONTEXT), [], 0, 0
    while (chunk := policy.next_chunk(frames, taken, covered, True)) is not None:
        out.append((chunk.start, chunk.end, chunk.keep_start - chunk.start))
        covered, taken = chunk.keep_end, taken + 1
    return out


def test_speech_walk_equals_speak(deployment: Deployment, plain) -> None:
    d = deployment
    thinker, talker, code2wav = plain
    engines = d.runtime.workers.workers[0].engines
    ids = _prompt_ids(d, "say something")
    speaker = talker.config.speaker_id[SPEAKER]
    assert special_codes(talker) == [i for i in range(40, 96) if i != talker.config.codec_eos_token_id]
    want = speak(thinker.text, talker, code2wav, ids, TOKENS, speaker, MAX_TOKENS, MAX_FRAMES,
                 suppressed=special_codes(talker))
    assert want.codes.shape[1] == MAX_FRAMES  # random weights never draw the codec EOS this early

    codes: list[torch.Tensor] = []
    original = engines["code2wav"].run
    engines["code2wav"].run = lambda items: (codes.extend(i.inputs["codes"] for i in items), original(items))[1]
    try:
        events = asyncio.run(_events(d, _spec("say something", "speech", ("text", "audio"))))
    finally:
        del engines["code2wav"].run
    assert _ids(events) == want.text_ids
    chunks = _chunks(events)
    cuts = _cuts(MAX_FRAMES)
    assert [c.shape[0] for c in codes] == [end - start for start, end, _ in cuts] == [3, 7, 12, 10]
    frames = torch.cat([c[keep:] for c, (_, _, keep) in zip(codes, cuts)]).T
    assert torch.equal(frames, want.codes)  # every frame once, in order: the talker's codes

    per_frame = code2wav.config.samples_per_frame
    whole = want.waveform.numpy()  # under 300 frames: speak's chunked decode is the whole decode
    peak = float(np.abs(whole).max())
    errors = []
    assert len(chunks) == len(cuts)
    for chunk, (first, end, keep) in zip(chunks, cuts):
        with torch.no_grad():  # the same cut decoded here: what the stream must send
            alone = code2wav(want.codes[:, first:end])[keep * per_frame:].numpy()
        np.testing.assert_array_equal(chunk, alone)
        region = whole[(first + keep) * per_frame:][:chunk.shape[0]]  # where the chunk's samples sit
        assert region.shape == chunk.shape
        errors.append(float(np.abs(chunk - region).max()) / peak)
    print(f"streamed chunks vs the whole decode, of the peak: {errors}")
    # A chunk whose context reaches the clip's start is the whole decode's, to rounding; the
    # last one's 8 frames of context are less than the codec's reach (2 layers of a 6-frame
    # window, and the convolutions'), as the release's 25 are less than its 72-frame window.
    assert [first for first, _, _ in cuts] == [0, 0, 0, 4]
    assert max(errors[:3]) < 1e-5 and errors[3] < 0.15, errors
    assert pcm_to_array([e for e in events if e.modality == "audio"]).shape[0] == sum(c.shape[0] for c in chunks)


def test_speech_walk_with_an_audio_prompt_equals_the_plain_pieces(deployment: Deployment, plain) -> None:
    """An audio question answered in speech: the talker's user rows take the audio tokens'
    thinker states through ``hidden_projection``. The plain pieces (``run_thinker`` on the
    spliced embeddings, ``talker_prompt``, ``run_talker``) give the same text and codes."""
    d = deployment
    thinker, talker, code2wav = plain
    content = [{"type": "audio", "data": CLIP}, {"type": "text", "text": "answer"}]
    inputs = d.spec.prepare_chat(_spec(content, "probe")).inputs
    ids = inputs["prompt_ids"]
    with torch.no_grad():
        embeds = splice_features(thinker.text.model.embed_tokens(ids), ids, AUDIO_TOKEN,
                                 thinker.audio_tower([inputs["audio_mels"]]))
        run = run_thinker(thinker.text, ids.tolist(), MAX_TOKENS, EOS, ACCEPT_HIDDEN_LAYER, prompt_embeds=embeds)
        tts = thinker.text.model.embed_tokens(torch.tensor([TOKENS.tts_bos, TOKENS.tts_eos, TOKENS.tts_pad]))
        prompt = talker_prompt(talker, TOKENS, talker.config.speaker_id[SPEAKER], ids.tolist(), run.generated,
                               run.embeds, run.hidden, tts)
        codes = run_talker(talker, prompt, MAX_FRAMES, special_codes(talker))
    seen: list[torch.Tensor] = []
    engine = d.runtime.workers.workers[0].engines["code2wav"]
    original = engine.run
    engine.run = lambda items: (seen.extend(i.inputs["codes"] for i in items), original(items))[1]
    try:
        events = asyncio.run(_events(d, _spec(content, "heard", ("text", "audio"))))
    finally:
        del engine.run
    assert _ids(events) == run.generated
    streamed = torch.cat([c[keep:] for c, (_, _, keep) in zip(seen, _cuts(codes.shape[1]))]).T
    assert torch.equal(streamed, codes)


def test_concurrent_requests_equal_solo(deployment: Deployment) -> None:
    d = deployment
    cases = [("plain text", ("text",)), ([{"type": "audio", "data": wav(0.9, 2)}, {"type": "text", "text": "?"}],
                                          ("text",)), ("speak up", ("text", "audio")),
             ([{"type": "image", "data": _png(3, (32, 32))}, {"type": "text", "text": "see"}], ("text",))]

    def summary(events):
        return _ids(events), b"".join(e.data for e in events if e.modality == "audio" and e.data)

    alone = [summary(asyncio.run(_events(d, _spec(c, f"alone{i}", o)))) for i, (c, o) in enumerate(cases)]
    assert alone[2][1] and not alone[0][1] and not alone[3][1]

    async def together():
        return await asyncio.gather(*(_events(d, _spec(c, f"both{i}", o)) for i, (c, o) in enumerate(cases)))

    # Whether the requests reach the conductor together depends on the machine's load (each is
    # prepared on a thread of its own): up to three tries for them to share thinker steps.
    thinker = d.runtime.workers.workers[0].engines["thinker"]
    for _ in range(3):
        with record_batches(thinker) as rec:
            assert [summary(events) for events in asyncio.run(asyncio.wait_for(together(), 120))] == alone
        if max(len(batch) for batch in rec.batches) > 1:
            break
    assert max(len(batch) for batch in rec.batches) > 1, "the requests never shared a thinker step"


def test_dummy_weights_build_every_part(checkpoint: Path) -> None:
    """``load_format: dummy``: the parts at the checkpoint's shapes, no tensor read."""
    ckpt = Qwen3OmniCheckpoint(checkpoint)
    cpu = torch.device("cpu")
    thinker = ckpt.thinker(cpu, torch.float32, dummy=True, seed=1)
    assert thinker.text.text_config.vocab_size == 160 and not thinker.training
    assert ckpt.talker(cpu, torch.float32, dummy=True, seed=2).config.num_code_groups == 5
    assert ckpt.code2wav(cpu, torch.float32, dummy=True, seed=3).config.samples_per_frame == 24


def test_generate_speaks_with_files(deployment: Deployment) -> None:
    d = deployment
    spec = GenerateSpec(request_id="gen-1", text="what is it?", files=[("clip.wav", CLIP)],
                        output_modalities=["text", "audio"], model_kwargs={"temperature": 0, "max_tokens": 4,
                                                                           "voice": SPEAKER})
    request = d.spec.prepare_generate(spec)
    assert request.walk == "speech" and request.inputs["audio_frames"].numel() == 1

    async def run():
        return [e async for e in d.backend.generate(spec)]

    events = asyncio.run(run())
    assert len(_ids(events)) == 4 and _chunks(events)


@pytest.mark.parametrize("spec, field", [
    (lambda: _spec("hi", "bad", ("text", "image")), "output_modalities"),
    (lambda: _spec("hi", "bad", ("audio", "video")), "output_modalities"),
    (lambda: _spec("hi", "bad", ("text", "audio"), voice="nobody"), "audio.voice"),
    (lambda: _spec([{"type": "video", "data": b"x"}], "bad"), "messages[0].content[0]"),
    (lambda: _spec([{"type": "image", "data": _png(4, (16, 16))}], "bad", ("text", "audio")), "output_modalities"),
    (lambda: _spec([{"type": "video", "data": CLIP_MP4}], "bad", ("text", "audio")), "output_modalities"),
    (lambda: _spec([{"type": "video", "data": mp4(1, (16, 16), 5.0, seed=6)}], "bad"), "messages[0].content[0]"),
    (lambda: _spec([{"type": "text", "text": "x"}, {"type": "audio", "data": b"\x89PNG\r\n\x1a\n" + bytes(64)}], "bad"),
     "messages[0].content[1]"),
    (lambda: _spec([{"type": "text", "text": "x"}, {"type": "audio", "data": bytes(range(256)) * 8}], "bad"),
     "messages[0].content[1]"),
    (lambda: _spec([{"type": "audio", "data": wav(2.5, 3)}], "bad"), "messages[0].content[0]"),
    (lambda: _spec([{"type": "image", "data": b"not an image"}], "bad"), "messages[0].content[0]"),
])
def test_bad_requests_name_the_field(deployment: Deployment, spec, field: str) -> None:
    with pytest.raises(RequestError) as err:
        deployment.spec.prepare_chat(spec())
    assert err.value.field == field and err.value.status == 400, err.value
