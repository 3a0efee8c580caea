"""Fish Audio S2-Pro served: text (with inline ``[tag]`` prosody, and optionally a reference
clip with its transcript) -> frames from the dual AR -> 44.1 kHz speech from the causal codec.

Two nodes: ``dual_ar`` (the slow AR on paged KV, batched across requests; each slow step runs
the fast AR over the frame's codebooks inside it, ``engine.FishRules``) and ``codec`` (the DAC
decoder, streamed: each chunk decodes only its new frames against the request's causal state,
``engine.CodecStreams``). The ``tts`` walk is the dual AR's prefill and a Loop of decodes,
each writing one frame; the frames reach the codec over a ``StreamEdge`` in a short ramp of
chunks, and its samples stream out as PCM.

Preparing a request (API-server side): the prompt is S2's three-turn chat (``prompt.py``);
cloning puts the clip's codes and ``ref_text`` in its system turn. The clip is encoded once
per content: ``condition_on_clip`` is ``cloning.encode_clip`` (the one clip -> codes step, a
function of the decoded waveform and its rate alone), memoised by ``VoiceCloning`` under a hash
of the samples and rate (``conditions_on_text`` off: one entry for a clip whatever transcript
comes with it; the memo's bytes are the ``conditioning_cache_mib`` knob). S2-Pro clones only
from a clip *with* its transcript: a clip without ``ref_text`` is a 400 naming it, checked
before anything is encoded. A ``voice`` naming a preset of the deployment's ``voices_dir``
(its clip and ``<name>.txt`` transcript) clones it as an upload of the same clip would, through
the same memo; any other ``voice`` is ignored (without a clip the model picks one). ``speed``
must be 1.0. The weights are under the Fish Audio Research License: non-commercial use only.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.config import ConfigError
from mstar.contract import GenerateSpec, RequestError, SpeechSpec, Voice, VoiceClip
from mstar.graph import Emit, Graph, Loop, Node, ScheduledChunks, Sequential, Step, StreamEdge, Walk
from mstar.model.decoding import decode_request
from mstar.model.fish_s2_pro.checkpoint import FishS2ProCheckpoint
from mstar.model.fish_s2_pro.cloning import check_transcript, encode_clip
from mstar.model.fish_s2_pro.knobs import FishS2ProKnobs, FishSpeechKnobs
from mstar.model.fish_s2_pro.prompt import Reference, build_prompt
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.speech_output import PcmStream, check_speech_generate
from mstar.model.voice_cloning import VoiceCloning, VoicePresets

__all__ = ["FishS2Pro"]

DUAL_AR, CODEC = "dual_ar", "codec"
DEFAULT_VOICE = "default"
MAX_INPUT_CHARS = 8192


@register
class FishS2Pro(VoiceCloning, ModelSpec):
    key = "fish_s2_pro"
    tasks = frozenset({"speech"})
    default_weights = "fishaudio/s2-pro"
    sample_rate = 44100  # the release's codec; load_frontend reads the checkpoint's
    validates_speech_options = True  # voice is ignored and speed checked here, not by the route
    Knobs = FishS2ProKnobs
    knobs: FishS2ProKnobs
    conditions_on_text = False  # the codes are the audio's alone; the transcript joins in ``_speak``
    conditioning_version = 2  # 2: the memo keeps the codes alone (1 kept them with the transcript)

    def graph(self) -> Graph:
        dual_ar = Node(DUAL_AR, "autoregressive", inputs=("prompt_ids", "prompt_codes", "token"),
                       outputs=("token", "codes"), ops=("prefill", "decode"), flags=("stop",))
        codec = Node(CODEC, "stream", inputs=("codes",), outputs=("audio",))
        writes = ("token", "codes")
        speak = Sequential(
            Step(DUAL_AR, "prefill", reads=("prompt_ids", "prompt_codes"), writes=writes),
            Loop(Step(DUAL_AR, "decode", reads="token", writes=writes), until="stop", max_iters="max_decode_steps"))
        policy = ScheduledChunks(tuple(self.knobs.codec_chunk_schedule), self.knobs.codec_chunk_frames)
        decode = StreamEdge("codes", into=Step(CODEC, reads="codes", writes="audio", emit=Emit("audio", "audio")),
                            policy=policy)
        return Graph.build([dual_ar, codec], [Walk("tts", speak, inputs=("prompt_ids", "prompt_codes"),
                                                   streams=[decode])])

    # -------------------------------------------------------------- frontend
    @property
    def dummy(self) -> bool:
        return self.config.load_format == "dummy"

    def checkpoint(self) -> FishS2ProCheckpoint:
        return FishS2ProCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.dual_config = ckpt.config()
        self.codec_config, encoder_config = ckpt.codec_configs()
        if self.dual_config.num_codebooks != self.codec_config.n_codebooks + 1:
            raise ConfigError(f"model_path: the dual AR makes {self.dual_config.num_codebooks} codes a frame; the "
                              f"codec reads {self.codec_config.n_codebooks + 1}")
        self.sample_rate = self.codec_config.sample_rate
        self.tokenizer = ckpt.tokenizer()
        # The clip encoder runs here, in the prepare thread (float32 on the CPU).
        self.encoder = ckpt.codec_encoder("cpu", dummy=self.dummy, seed=self.knobs.seed + 2,
                                          config=self.codec_config, encoder=encoder_config).eval()
        self.presets = VoicePresets(self.knobs.voices_dir) if self.knobs.voices_dir else None

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    def voices(self) -> list[str]:
        presets = getattr(self, "presets", None)
        return [DEFAULT_VOICE, *(presets.names if presets is not None else [])]

    def voice_list(self) -> list[Voice]:
        presets = getattr(self, "presets", None)
        return [Voice(DEFAULT_VOICE, None, "bundled"), *(presets.voices() if presets is not None else [])]

    def condition_on_clip(self, samples: np.ndarray, sample_rate: int, ref_text: str | None) -> torch.Tensor:
        """The clip's codes ``[N, frames]`` (the transcript is not read: see the module doc)."""
        return encode_clip(self.encoder, samples, sample_rate)

    def preset_clip(self, voice: str) -> VoiceClip:
        """The clip of preset ``voice``; one without a transcript is refused naming ``voice``."""
        clip = self.presets.clip(voice)
        if not clip.text or not clip.text.strip():
            raise RequestError("voice", f"the preset {voice!r} has no transcript ({voice}.txt beside its clip); "
                               "S2-Pro clones from a clip and its transcript")
        return clip

    def reference(self, clip: VoiceClip) -> Reference:
        """A clip and its transcript as the prompt's system turn takes them (the codes memoised)."""
        text = check_transcript(clip.text)
        return Reference(text, self.clip_conditioning(clip))

    def prepare_speech(self, spec: SpeechSpec) -> WalkRequest:
        if spec.speed != 1.0:
            raise RequestError("speed", "S2-Pro cannot change its speaking rate; send speed 1.0")
        clip = spec.reference
        presets = getattr(self, "presets", None)
        if clip is None and presets is not None and spec.voice in presets:
            clip = self.preset_clip(spec.voice)
        return self._speak(spec.input, clip, FishSpeechKnobs.parse(spec.model_kwargs))

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        check_speech_generate(self.key, spec, clones=True)
        return self._speak(spec.text, spec.reference, FishSpeechKnobs.parse(spec.model_kwargs))

    def _speak(self, text: str, clip: VoiceClip | None, options: FishSpeechKnobs) -> WalkRequest:
        text = text.strip()
        if not text:
            raise RequestError("input", "must contain text, not only whitespace")
        if len(text) > MAX_INPUT_CHARS:
            raise RequestError("input", f"is {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
        references = [self.reference(clip)] if clip is not None else []
        c = self.dual_config
        tokens, codes = build_prompt(self.tokenizer, text, references, c.semantic_begin_id, c.num_codebooks)
        room = self.config.max_seq_len - len(tokens)
        if room < 1:
            raise RequestError("input" if clip is None else "ref_audio",
                               f"makes a {len(tokens)}-token prompt; max_seq_len is {self.config.max_seq_len}")
        frames = min(options.frames or self.knobs.max_new_frames, room)
        seed = options.seed if options.seed is not None else int(torch.seed() % (1 << 31))
        sampling = {"temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k, "seed": seed}
        return decode_request("tts", {"prompt_ids": tokens, "prompt_codes": codes}, len(tokens), frames, sampling,
                              [] if options.ignore_eos else [c.eos_token_id], self.config, upfront=True,
                              repetition_aware=options.repetition_aware, ignore_eos=options.ignore_eos)

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PcmStream:
        return PcmStream(self.sample_rate)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.fish_s2_pro.engine import CodecStreams, dual_ar_engine

        ckpt, kv = self.checkpoint(), self.config.resources.kv_cache
        engines = {}
        if DUAL_AR in nodes:
            model = ckpt.dual_ar(device, self.config.torch_dtype(), dummy=self.dummy, seed=self.knobs.seed).eval()
            engines[DUAL_AR] = dual_ar_engine(model, num_pages=kv.max_num_pages, page_size=kv.page_size,
                                              max_seq_len=self.config.max_seq_len, device=device,
                                              dtype=self.config.torch_dtype())
        if CODEC in nodes:  # float32: the reference decoder's numerics
            codec_config, _ = ckpt.codec_configs()
            codec = ckpt.codec(device, dummy=self.dummy, seed=self.knobs.seed + 1, config=codec_config).eval()
            engines[CODEC] = CodecStreams(codec)
        return engines
