// The playground's panels: chat, speech, transcription and images, each shown when the served
// model lists its task in /v1/models. Every call goes to this server's own API, with the key
// typed in the header field as a Bearer token; the page itself holds nothing secret.
import { encodeWav, recordMicrophone } from "./audio.js";
import { VoiceAgent } from "./realtime.js";

const $ = (id) => document.getElementById(id);
const state = { model: null, tasks: [], apiKey: "" };

// ---------------------------------------------------------------- the API

function authHeaders(extra = {}) {
  return state.apiKey ? { ...extra, Authorization: `Bearer ${state.apiKey}` } : extra;
}

// An API URL relative to the page, so that the playground also works behind a path prefix.
function apiUrl(path) {
  return new URL(path, document.baseURI);
}

// The message of an OpenAI-style error body, or the status line when the body has none.
async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

async function api(path, init = {}) {
  const response = await fetch(apiUrl(path), { ...init, headers: authHeaders(init.headers) });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "muted";
}

// Runs a panel's action with its submit button disabled, reporting a failure in the status line.
async function busy(button, action) {
  button.disabled = true;
  setStatus("Working…");
  try {
    await action();
    setStatus("Ready.");
  } catch (err) {
    setStatus(err.message, true);
  } finally {
    button.disabled = false;
  }
}

// ---------------------------------------------------------------- chat

const chat = { messages: [], controller: null };

function addMessage(log, role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  log.append(div);
  log.scrollTop = log.scrollHeight;
  return div;
}

// The SSE `data:` payloads of a streamed response, parsed, as they arrive.
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function sendChat(event) {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || chat.controller) return;
  $("chat-input").value = "";
  const conversation = chat.messages;  // Clear during the reply starts a new one: this turn stays here
  conversation.push({ role: "user", content: text });
  addMessage($("chat-log"), "user", text);
  const reply = addMessage($("chat-log"), "assistant", "");
  reply.dataset.state = "streaming";
  chat.controller = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  const body = {
    model: state.model, messages: conversation, stream: true,
    max_tokens: Number($("chat-max-tokens").value) || undefined,
  };
  // Left empty, the model's own default (a generation config's, or the server's) applies.
  if ($("chat-temperature").value !== "") body.temperature = Number($("chat-temperature").value);
  try {
    const response = await api("v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: chat.controller.signal,
    });
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        reply.textContent += delta.content;
        $("chat-log").scrollTop = $("chat-log").scrollHeight;
      }
    }
    reply.dataset.state = "done";
  } catch (err) {
    reply.dataset.state = err.name === "AbortError" ? "stopped" : "error";
    if (err.name !== "AbortError") addMessage($("chat-log"), "error", err.message);
  } finally {
    // What was written stays in the conversation, even when it was stopped part way.
    if (reply.textContent) {
      conversation.push({ role: "assistant", content: reply.textContent });
    } else {
      conversation.pop();  // no reply: the question is not sent again next turn
      reply.remove();
    }
    chat.controller = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

function setUpChat() {
  $("chat-form").addEventListener("submit", sendChat);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("chat-stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("chat-clear").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.messages = [];
    $("chat-log").replaceChildren();
  });
}

// ---------------------------------------------------------------- speech

let speechUrl = null;

async function loadVoices() {
  const response = await api(`v1/audio/voices?model=${encodeURIComponent(state.model)}`);
  const { voices } = await response.json();
  $("speech-voice").replaceChildren(...voices.map((v) => {
    const option = document.createElement("option");
    option.value = v.voice_id;
    option.textContent = v.language ? `${v.name} (${v.language})` : v.name;
    return option;
  }));
}

async function speak() {
  const body = { model: state.model, input: $("speech-input").value, response_format: "wav" };
  if ($("speech-voice").value) body.voice = $("speech-voice").value;
  const response = await api("v1/audio/speech", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const audio = $("speech-audio");
  if (speechUrl) URL.revokeObjectURL(speechUrl);
  speechUrl = URL.createObjectURL(await response.blob());
  audio.src = speechUrl;
  try {
    await audio.play();
  } catch (err) {
    // A browser that blocks playing without a fresh click: the audio is there, press play.
    if (err.name !== "NotAllowedError") throw err;
  }
}

function setUpSpeech() {
  $("speech-form").addEventListener("submit", (e) => {
    e.preventDefault();
    busy($("speech-send"), speak);
  });
}

// ---------------------------------------------------------------- transcription

let recording = null;  // the microphone while recording: { stop() -> Promise<{samples, sampleRate}> }

async function transcribe(file, name) {
  const translate = $("transcription-translate").checked;
  const form = new FormData();
  form.append("file", file, name);
  form.append("model", state.model);
  const path = translate ? "v1/audio/translations" : "v1/audio/transcriptions";
  $("transcript").textContent = "…";
  const response = await api(path, { method: "POST", body: form });
  $("transcript").textContent = (await response.json()).text;
}

async function toggleRecording() {
  const button = $("transcription-record");
  if (!recording) {
    recording = await recordMicrophone();
    button.textContent = "Stop and transcribe";
    return;
  }
  const { samples, sampleRate } = await recording.stop();
  recording = null;
  button.textContent = "Record";
  await transcribe(encodeWav(samples, sampleRate), "microphone.wav");
}

function setUpTranscription() {
  $("transcription-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const file = $("transcription-file").files[0];
    if (!file) { setStatus("choose an audio file first", true); return; }
    busy($("transcription-send"), () => transcribe(file, file.name));
  });
  $("transcription-record").addEventListener("click", () => toggleRecording().catch((err) => {
    recording = null;
    $("transcription-record").textContent = "Record";
    setStatus(err.message, true);
  }));
}

// ---------------------------------------------------------------- images

async function generateImage() {
  const body = { model: state.model, prompt: $("image-prompt").value, size: $("image-size").value, n: 1 };
  if ($("image-steps").value) body.num_inference_steps = Number($("image-steps").value);
  if ($("image-seed").value) body.seed = Number($("image-seed").value);
  const response = await api("v1/images/generations", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const { data } = await response.json();
  $("image-result").src = `data:image/png;base64,${data[0].b64_json}`;
  $("image-result").hidden = false;
}

function setUpImages() {
  $("image-form").addEventListener("submit", (e) => {
    e.preventDefault();
    busy($("image-send"), generateImage);
  });
}

// ---------------------------------------------------------------- voice agent

let agent = null;

function setUpRealtime() {
  const start = $("realtime-start"), stop = $("realtime-stop");
  const ended = () => { agent = null; start.disabled = false; stop.disabled = true; };
  start.addEventListener("click", async () => {
    start.disabled = true;
    agent = new VoiceAgent({
      url: apiUrl(`v1/realtime?model=${encodeURIComponent(state.model)}`),
      apiKey: state.apiKey, log: $("realtime-log"), stateLine: $("realtime-state"), onClose: ended,
    });
    window.voiceAgent = agent;  // to look at from the console (and from the browser test)
    try {
      await agent.start();
      stop.disabled = false;
    } catch (err) {
      setStatus(err.message, true);
      agent.stop();
    }
  });
  stop.addEventListener("click", () => agent && agent.stop());
}

// ---------------------------------------------------------------- start-up

// Shows the panels of the model's tasks; a model card without `tasks` (an older server)
// shows chat only.
function showPanels() {
  let shown = 0;
  for (const panel of document.querySelectorAll(".panel")) {
    panel.hidden = !state.tasks.includes(panel.dataset.task);
    if (!panel.hidden) shown += 1;
  }
  $("transcription-translate-label").hidden = !state.tasks.includes("translation");
  if (!state.tasks.includes("transcription") && state.tasks.includes("translation")) {
    $("panel-transcription").hidden = false;  // a translate-only model: the same panel
    $("transcription-translate").checked = true;
    shown += 1;
  }
  $("no-panels").hidden = shown > 0;
}

async function connect() {
  state.apiKey = $("api-key").value.trim();
  setStatus("Connecting…");
  try {
    const { data } = await (await api("v1/models")).json();
    state.model = data[0].id;
    state.tasks = data[0].tasks || ["chat"];
    $("model-name").textContent = `${state.model}: ${state.tasks.join(", ")}`;
    showPanels();
    if (state.tasks.includes("speech")) await loadVoices();
    setStatus("Ready.");
    document.body.dataset.ready = "true";
  } catch (err) {
    const hint = err.message.startsWith("401") ? " Type the server's API key above and connect." : "";
    setStatus(`${err.message}${hint}`, true);
  }
}

function main() {
  setUpChat();
  setUpSpeech();
  setUpTranscription();
  setUpImages();
  setUpRealtime();
  $("key-form").addEventListener("submit", (e) => { e.preventDefault(); connect(); });
  connect();
}

main();
