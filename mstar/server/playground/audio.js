// Audio in and out of the page: microphone capture through an AudioWorklet, resampling, WAV
// and PCM16 encoding, and a player for PCM chunks that arrive over time. Shared by the
// transcription panel (record, then upload a WAV) and the voice agent (stream PCM16 at 24 kHz).

// Opens the microphone and calls `onSamples(Float32Array, sampleRate)` with mono frames at the
// context's rate (the device's, often 48 kHz) until `stop()`. Echo cancellation is asked for so that the
// voice agent does not hear its own reply as the user speaking over it.
export async function openMicrophone(onSamples) {
  const stream = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true },
  });
  const context = new AudioContext();
  try {
    await context.audioWorklet.addModule(new URL("capture-worklet.js", import.meta.url));
  } catch (err) {
    stream.getTracks().forEach((t) => t.stop());
    await context.close();
    throw err;
  }
  const source = context.createMediaStreamSource(stream);
  const capture = new AudioWorkletNode(context, "capture");
  capture.port.onmessage = (event) => onSamples(event.data, context.sampleRate);
  // A muted path to the output keeps the graph pulling the worklet on every browser.
  const mute = context.createGain();
  mute.gain.value = 0;
  source.connect(capture).connect(mute).connect(context.destination);
  await context.resume();
  return {
    sampleRate: context.sampleRate,
    async stop() {
      capture.port.onmessage = null;
      stream.getTracks().forEach((t) => t.stop());
      await context.close();
    },
  };
}

// Records the microphone until `stop()`, which resolves to all of it at 16 kHz (what speech
// recognisers read; a third of a 48 kHz upload).
export async function recordMicrophone() {
  const parts = [];
  const mic = await openMicrophone((samples) => parts.push(samples));
  return {
    async stop() {
      await mic.stop();
      const resampler = new Resampler(mic.sampleRate, 16000);
      return { samples: resampler.push(concat(parts)), sampleRate: 16000 };
    },
  };
}

export function concat(parts) {
  const out = new Float32Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const part of parts) { out.set(part, at); at += part.length; }
  return out;
}

// A streaming resampler: linear interpolation between neighbouring input samples, carried
// across chunks, after averaging over the input span of one output sample when going down (a
// cheap low-pass, so 48 kHz -> 24 kHz does not fold the top octave into speech).
export class Resampler {
  constructor(fromRate, toRate) {
    this.step = fromRate / toRate;  // input samples per output sample
    this.position = 0;  // where the next output sample falls, in input samples from `previous`
    this.previous = null;  // the last input samples of the previous chunk, for continuity
  }

  push(chunk) {
    if (this.step === 1) return chunk;
    const width = Math.max(1, Math.round(this.step));
    const input = this.smooth(chunk, width);
    const out = [];
    while (this.position + 1 < input.length) {
      const i = Math.floor(this.position), frac = this.position - i;
      out.push(input[i] * (1 - frac) + input[i + 1] * frac);
      this.position += this.step;
    }
    const keep = Math.min(input.length, Math.floor(this.position));
    this.position -= keep;
    this.previous = { tail: chunk.slice(Math.max(0, chunk.length - width)), last: input.slice(keep) };
    return Float32Array.from(out);
  }

  // The chunk averaged over `width` samples (history from the last chunk included), with the
  // samples left over from the last chunk put in front.
  smooth(chunk, width) {
    const history = this.previous ? this.previous.tail : new Float32Array(0);
    const carried = this.previous ? this.previous.last : new Float32Array(0);
    const joined = concat([history, chunk]);
    const smoothed = new Float32Array(chunk.length);
    let sum = 0;
    for (let i = 0; i < joined.length; i += 1) {
      sum += joined[i];
      if (i >= width) sum -= joined[i - width];
      const at = i - history.length;
      if (at >= 0) smoothed[at] = sum / Math.min(width, i + 1);
    }
    return concat([carried, smoothed]);
  }
}

// Float samples in [-1, 1] as little-endian 16-bit PCM.
export function toPcm16(samples) {
  const out = new DataView(new ArrayBuffer(samples.length * 2));
  samples.forEach((s, i) => out.setInt16(i * 2, Math.max(-1, Math.min(1, s)) * 0x7fff, true));
  return out.buffer;
}

export function fromPcm16(buffer) {
  const view = new DataView(buffer);
  const out = new Float32Array(buffer.byteLength >> 1);
  for (let i = 0; i < out.length; i += 1) out[i] = view.getInt16(i * 2, true) / 0x8000;
  return out;
}

export function toBase64(buffer) {
  const bytes = new Uint8Array(buffer);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

export function fromBase64(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i += 1) bytes[i] = binary.charCodeAt(i);
  return bytes.buffer;
}

// A mono 16-bit WAV file of `samples` at `sampleRate`.
export function encodeWav(samples, sampleRate) {
  const header = new DataView(new ArrayBuffer(44));
  const text = (at, s) => [...s].forEach((c, i) => header.setUint8(at + i, c.charCodeAt(0)));
  const dataBytes = samples.length * 2;
  text(0, "RIFF"); header.setUint32(4, 36 + dataBytes, true); text(8, "WAVE");
  text(12, "fmt "); header.setUint32(16, 16, true); header.setUint16(20, 1, true);  // PCM
  header.setUint16(22, 1, true); header.setUint32(24, sampleRate, true);  // mono
  header.setUint32(28, sampleRate * 2, true); header.setUint16(32, 2, true); header.setUint16(34, 16, true);
  text(36, "data"); header.setUint32(40, dataBytes, true);
  return new Blob([header.buffer, toPcm16(samples)], { type: "audio/wav" });
}

// Plays PCM chunks back to back as they arrive; `stop()` silences what is queued at once (the
// voice agent's barge-in). `played` counts the chunks scheduled, for tests and the state line.
export class PcmPlayer {
  constructor(sampleRate) {
    this.context = new AudioContext({ sampleRate });
    this.sources = new Set();
    this.nextStart = 0;
    this.played = 0;
  }

  play(samples) {
    const buffer = this.context.createBuffer(1, samples.length, this.context.sampleRate);
    buffer.copyToChannel(samples, 0);
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    source.onended = () => this.sources.delete(source);
    this.nextStart = Math.max(this.nextStart, this.context.currentTime + 0.02);
    source.start(this.nextStart);
    this.nextStart += buffer.duration;
    this.sources.add(source);
    this.played += 1;
  }

  get playing() {
    return this.sources.size > 0;
  }

  stop() {
    for (const source of this.sources) source.stop();
    this.sources.clear();
    this.nextStart = 0;
  }

  async close() {
    this.stop();
    await this.context.close();
  }
}
