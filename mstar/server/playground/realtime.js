// The voice agent: the microphone streamed to /v1/realtime (OpenAI's Realtime API, GA event
// names) as PCM16 mono at 24 kHz, the reply's audio played as it arrives, and the user's speech
// over a reply (the server's `input_audio_buffer.speech_started`) silencing it at once.
import { concat, fromBase64, fromPcm16, openMicrophone, PcmPlayer, Resampler, toBase64, toPcm16 } from "./audio.js";

const RATE = 24000;  // the API's audio/pcm rate, both ways
const SEND_SAMPLES = 2400;  // 100 ms per input_audio_buffer.append

export class VoiceAgent {
  // url: the /v1/realtime URL (http(s), turned into ws(s)); apiKey: sent as the subprotocol
  // OpenAI's browser clients use, since a browser cannot set headers on a WebSocket; log: where
  // the turns are written; stateLine: one word on what is happening; onClose: called once.
  constructor({ url, apiKey, log, stateLine, onClose }) {
    this.url = new URL(url);
    this.url.protocol = this.url.protocol === "https:" ? "wss:" : "ws:";
    this.apiKey = apiKey;
    this.log = log;
    this.stateLine = stateLine;
    this.onClose = onClose;
    this.socket = null;
    this.mic = null;
    this.player = null;
    this.pending = new Float32Array(0);  // resampled input not yet sent
    this.replies = new Map();  // response id -> its transcript element
    this.closed = false;
  }

  async start() {
    this.player = new PcmPlayer(RATE);
    this.socket = await this.connect();
    this.socket.onmessage = (event) => this.handle(JSON.parse(event.data));
    this.socket.onclose = (event) => this.stop(event.code === 1000 ? "" : `closed: ${event.reason || event.code}`);
    this.send({
      type: "session.update",
      session: {
        type: "realtime",
        output_modalities: ["audio"],
        audio: {
          input: { format: { type: "audio/pcm", rate: RATE }, turn_detection: { type: "server_vad" } },
          output: { format: { type: "audio/pcm", rate: RATE } },
        },
      },
    });
    let resampler = null;
    this.mic = await openMicrophone((samples, sampleRate) => {
      resampler = resampler || new Resampler(sampleRate, RATE);
      this.queue(resampler.push(samples));
    });
    this.setState("listening");
  }

  connect() {
    const protocols = this.apiKey ? ["realtime", `openai-insecure-api-key.${this.apiKey}`] : [];
    const socket = new WebSocket(this.url, protocols);
    return new Promise((resolve, reject) => {
      socket.onopen = () => resolve(socket);
      socket.onerror = () => reject(new Error(`cannot open ${this.url.pathname}`));
    });
  }

  send(event) {
    if (this.socket && this.socket.readyState === WebSocket.OPEN) this.socket.send(JSON.stringify(event));
  }

  // Input goes out in appends of 100 ms each: fewer, larger messages than the capture blocks.
  queue(samples) {
    this.pending = concat([this.pending, samples]);
    let at = 0;
    for (; at + SEND_SAMPLES <= this.pending.length; at += SEND_SAMPLES) {
      const piece = this.pending.subarray(at, at + SEND_SAMPLES);
      this.send({ type: "input_audio_buffer.append", audio: toBase64(toPcm16(piece)) });
    }
    this.pending = this.pending.slice(at);
  }

  handle(event) {
    switch (event.type) {
      case "input_audio_buffer.speech_started":
        this.player.stop();  // barge-in: the user talks over the reply
        this.setState("hearing you");
        break;
      case "input_audio_buffer.speech_stopped":
        this.setState("thinking");
        break;
      case "conversation.item.input_audio_transcription.completed":
        this.line("user", event.transcript);
        break;
      case "response.output_audio.delta":
        this.player.play(fromPcm16(fromBase64(event.delta)));
        this.setState("speaking");
        break;
      case "response.output_audio_transcript.delta":
      case "response.output_text.delta":
        this.reply(event.response_id).textContent += event.delta;
        break;
      case "response.done":
        this.replies.delete(event.response && event.response.id);
        this.setState("listening");
        break;
      case "error":
        this.line("error", (event.error && event.error.message) || "error");
        break;
      default:
        break;  // session.created, *.done duplicates of the deltas, rate limits: nothing to show
    }
  }

  reply(responseId) {
    if (!this.replies.has(responseId)) this.replies.set(responseId, this.line("assistant", ""));
    return this.replies.get(responseId);
  }

  line(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.textContent = text;
    this.log.append(div);
    this.log.scrollTop = this.log.scrollHeight;
    return div;
  }

  setState(text) {
    this.stateLine.textContent = text;
  }

  stop(reason = "") {
    if (this.closed) return;
    this.closed = true;
    if (this.socket) { this.socket.onclose = null; this.socket.close(1000); }
    if (this.mic) this.mic.stop();
    if (this.player) this.player.close();
    if (reason) this.line("error", reason);
    this.setState("stopped");
    this.onClose();
  }
}
