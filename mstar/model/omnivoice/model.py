"""OmniVoice served: text (+ a voice clip and its transcript) -> a canvas unmasked in a few
steps -> 24 kHz speech.

Graph: ``canvas`` (``engine.canvas_fn``: one unmasking step of every ready request in one
backbone forward) in a denoise ``Loop`` of ``num_steps`` iterations, the loop-carried state
being the request's conditional canvas row; then ``codec`` decodes its target codes and emits
the audio (whole, at the end: nothing is audible before the last step).

Preparing a request (API-server side): a clip is resampled to the codec's rate, raised to
0.1 RMS if quieter, cut to whole frames and encoded to codes, once per content whatever its
transcript (``VoiceCloning``); the transcript (``ref_text``, required) gets a closing full stop. The
target length follows the character-weight rule (``prompt.target_frames``) over the clip's
speaking rate, divided by ``speed``. Without a clip (voice ``auto``) the model picks a voice;
a preset of the deployment's ``voices_dir`` is a ``voice`` cloned as its clip would be.
Not ported: the reference's silence trimming of clips and output (pydub), its chunked
generation above 30 s (refused here beyond ``max_seconds``), voice design (``instruct``) and
text normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mstar.contract import GenerateSpec, RequestError, SpeechSpec, Voice, VoiceClip
from mstar.engine.base import StatelessEngine
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.omnivoice.checkpoint import HUB_ID, OmniVoiceCheckpoint
from mstar.model.omnivoice.engine import canvas_fn, codec_fn, unmask_params
from mstar.model.omnivoice.knobs import OmniVoiceGenerateKnobs, OmniVoiceKnobs, OmniVoiceSpeechKnobs
from mstar.model.omnivoice.prompt import end_with_punctuation, prompt_row, resolve_language, target_frames
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.speech_output import PcmStream, check_speech_generate
from mstar.model.voice_cloning import VoiceCloning, VoicePresets

__all__ = ["ClipCodes", "ClipPrompt", "OmniVoice"]

AUTO_VOICE = "auto"
MIN_REF_RMS = 0.1


@dataclass(frozen=True)
class ClipCodes:
    """What a reference clip encodes to (memoised by its audio): codes ``[C, T]`` and the
    clip's loudness before it was raised."""

    codes: torch.Tensor
    rms: float


@dataclass(frozen=True)
class ClipPrompt:
    """A reference clip as the canvas takes it: its codes ``[C, T]``, transcript and loudness."""

    codes: torch.Tensor
    text: str
    rms: float


@register
class OmniVoice(VoiceCloning, ModelSpec):
    key = "omnivoice"
    tasks = frozenset({"speech"})
    default_weights = HUB_ID
    sample_rate = 24000  # the released codec's; load_frontend reads the checkpoint's
    validates_speech_options = True  # speed and the voice (``auto`` or a clip) are checked here
    Knobs = OmniVoiceKnobs
    knobs: OmniVoiceKnobs
    conditions_on_text = False  # the codes are the audio's alone; the transcript joins in ``clip_prompt``

    def graph(self) -> Graph:
        canvas = Node("canvas", "stateless", inputs=("canvas",), outputs=("canvas",), ops=("step",))
        codec = Node("codec", "stateless", inputs=("canvas",), outputs=("audio",), ops=("decode",))
        tts = Walk("tts", Sequential(
            Loop(Step("canvas", "step", reads="canvas", writes="canvas"), max_iters="num_steps", progress=True),
            Step("codec", "decode", reads="canvas", writes="audio", emit=Emit("audio", "audio")),
        ), inputs=("canvas",))
        return Graph.build([canvas, codec], [tts])

    # -------------------------------------------------------------- frontend
    @property
    def dummy(self) -> bool:
        return self.config.load_format == "dummy"

    def checkpoint(self) -> OmniVoiceCheckpoint:
        return OmniVoiceCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.model_config = ckpt.config()
        self.sample_rate = self.model_config.codec.sample_rate
        self.tokenizer = ckpt.tokenizer()
        # The clip encoder runs here, in the prepare thread (float32 on the CPU).
        self.codec = ckpt.load_codec("cpu", dummy=self.dummy, seed=self.knobs.seed)
        self.presets = VoicePresets(self.knobs.voices_dir) if self.knobs.voices_dir else None

    def voices(self) -> list[str]:
        presets = getattr(self, "presets", None)
        return [AUTO_VOICE, *(presets.names if presets is not None else [])]

    def voice_list(self) -> list[Voice]:
        presets = getattr(self, "presets", None)
        return [Voice(AUTO_VOICE, None, "bundled"), *(presets.voices() if presets is not None else [])]

    def preset_clip(self, voice: str) -> VoiceClip:
        """The clip of preset ``voice``; one without a transcript is refused naming ``voice``."""
        clip = self.presets.clip(voice)
        if not clip.text:
            raise RequestError("voice", f"the preset {voice!r} has no transcript ({voice}.txt beside its clip); "
                               "OmniVoice clones from a clip and its transcript")
        return clip

    def clip_prompt(self, clip: VoiceClip) -> ClipPrompt:
        """A clip and its transcript as the canvas takes them (the codes memoised)."""
        if not clip.text:
            raise RequestError("ref_text", "OmniVoice clones from a clip and its transcript: send ref_text with "
                               "ref_audio")
        encoded: ClipCodes = self.clip_conditioning(clip)
        return ClipPrompt(encoded.codes, end_with_punctuation(clip.text), encoded.rms)

    def condition_on_clip(self, samples: np.ndarray, sample_rate: int, ref_text: str | None) -> ClipCodes:
        from mstar.audio.io import resample

        codec = self.model_config.codec
        wave = resample(np.asarray(samples, dtype=np.float32), sample_rate, codec.sample_rate)
        rms = float(np.sqrt(np.mean(wave.astype(np.float64) ** 2))) if wave.size else 0.0
        if 0 < rms < MIN_REF_RMS:
            wave = wave * (MIN_REF_RMS / rms)
        wave = wave[: wave.size - wave.size % codec.hop_length]
        if wave.size == 0:
            raise RequestError("ref_audio", f"the clip is shorter than one codec frame ({codec.hop_length} samples "
                               f"at {codec.sample_rate} Hz)")
        semantic = resample(wave, codec.sample_rate, codec.semantic_sample_rate)
        with torch.inference_mode():
            codes = self.codec.encode(torch.from_numpy(np.ascontiguousarray(wave))[None],
                                      torch.from_numpy(np.ascontiguousarray(semantic))[None],
                                      self.model_config.num_audio_codebook)[0]
        return ClipCodes(codes, rms)

    def prepare_speech(self, spec: SpeechSpec) -> WalkRequest:
        options = OmniVoiceSpeechKnobs.parse(spec.model_kwargs)
        return self._speak(spec.input, spec.voice, spec.reference, spec.speed, options)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        check_speech_generate(self.key, spec, clones=True)
        options = OmniVoiceGenerateKnobs.parse(spec.model_kwargs)
        return self._speak(spec.text, None, spec.reference, options.speed, options)

    def _speak(self, text: str, voice: str | None, reference: VoiceClip | None, speed: float,
               options: OmniVoiceSpeechKnobs) -> WalkRequest:
        if reference is None and voice not in (None, AUTO_VOICE):
            if self.presets is None or voice not in self.presets:
                known = ", ".join(self.voices())
                raise RequestError("voice", f"unknown voice {voice!r}: the voices are {known}; send ref_audio and "
                                   "ref_text to clone another")
            reference = self.preset_clip(voice)
        if not 0.25 <= speed <= 4.0:
            raise RequestError("speed", f"{speed:g} is outside 0.25 to 4.0")
        if not text.strip():
            raise RequestError("input", "must contain text, not only whitespace")
        clip = self.clip_prompt(reference) if reference is not None else None
        config = self.model_config
        target = target_frames(text, clip.text if clip else None, clip.codes.shape[1] if clip else None, speed)
        limit = int(self.knobs.max_seconds * config.codec.frame_rate)
        if target > limit:
            raise RequestError("input", f"would be {target / config.codec.frame_rate:.1f} s of speech; the limit is "
                               f"{self.knobs.max_seconds:g} s (max_seconds)")
        row, audio_start = prompt_row(self.tokenizer, config.num_audio_codebook, config.audio_mask_id, text, target,
                                      language=resolve_language(options.language),
                                      ref_text=clip.text if clip else None, ref_codes=clip.codes if clip else None,
                                      denoise=self.knobs.denoise)
        if row.shape[1] > self.config.max_seq_len:
            raise RequestError("input", f"makes a canvas of {row.shape[1]} positions; max_seq_len is "
                               f"{self.config.max_seq_len}")
        knobs = self.knobs.unmask(options.num_step, options.guidance_scale)
        seed = options.seed if options.seed is not None else int(torch.seed() % (1 << 31))
        params = {**unmask_params(knobs, config.num_audio_codebook, target), "target_len": target,
                  "audio_start": audio_start, "seed": seed, "ref_rms": clip.rms if clip else None}
        return WalkRequest("tts", {"canvas": row}, params, prompt_tokens=audio_start)

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PcmStream:
        return PcmStream(self.sample_rate)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        wanted = nodes & {"canvas", "codec"}
        if not wanted:
            return {}
        dtype = self.config.torch_dtype() if device.type == "cuda" else torch.float32
        model = self.checkpoint().load_model(device, dtype, dummy=self.dummy, seed=self.knobs.seed)
        engines = {}
        if "canvas" in wanted:
            engines["canvas"] = StatelessEngine(canvas_fn(model.backbone, self.knobs.max_batch_size))
        if "codec" in wanted:
            engines["codec"] = StatelessEngine(codec_fn(model.codec))
        return engines
