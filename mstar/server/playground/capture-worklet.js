// Runs on the audio thread: hands the microphone's first channel to the page in blocks of
// about 40 ms (the render quantum is 128 frames, too many messages at 375 a second).
const BLOCK_FRAMES = 2048;

class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.block = new Float32Array(BLOCK_FRAMES);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) {
      let from = 0;
      while (from < channel.length) {
        const take = Math.min(channel.length - from, BLOCK_FRAMES - this.filled);
        this.block.set(channel.subarray(from, from + take), this.filled);
        this.filled += take;
        from += take;
        if (this.filled === BLOCK_FRAMES) {
          this.port.postMessage(this.block);
          this.block = new Float32Array(BLOCK_FRAMES);
          this.filled = 0;
        }
      }
    }
    return true;
  }
}

registerProcessor("capture", CaptureProcessor);
