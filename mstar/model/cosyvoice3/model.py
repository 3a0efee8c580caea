"""CosyVoice3 served: text + a cloned voice -> speech tokens -> flow chunks -> causal HiFT ->
24 kHz audio, streamed while the LM talks.

Graph: ``llm`` (the shared autoregressive engine over ``SpeechLM``, ``engine.RasRules``
choosing tokens, so requests batch) writes a speech ``token`` per step; a stream edge
(``serving.HoldOne``) hands the new tokens to ``vocoder`` (``serving.VocodeEngine``), which
runs the flow whenever the reference's ``StreamPlanner`` says so and the causal HiFT on the mel
so far, emitting the new samples. Joined, a request's audio is ``synthesis.stream_audio`` of
``synthesis.speech_tokens`` with the same seed.

Preparing a request (API-server side): every request clones, from its ``ref_audio`` clip or a
preset of ``voices_dir``, encoded once per content (``VoiceCloning``); the text is cut into
sentence pieces (one walk each, played in order) unless ``sentence_chunking`` is off.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from mstar.contract import GenerateSpec, RequestError, SpeechSpec, Voice, VoiceClip
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, StreamEdge, Walk
from mstar.model.cosyvoice3 import serving
from mstar.model.cosyvoice3.engine import RasRules, lm_params
from mstar.model.cosyvoice3.knobs import CosyVoice3GenerateKnobs, CosyVoice3Knobs, CosyVoice3SpeechKnobs
from mstar.model.cosyvoice3.lm import length_bounds
from mstar.model.cosyvoice3.synthesis import VoicePrompt
from mstar.model.decode_engines import decode_engine
from mstar.model.decoding import decode_request
from mstar.model.registry import register
from mstar.model.sentences import SentenceChunker
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.speech_output import PcmStream, check_speech_generate
from mstar.model.voice_cloning import VoiceCloning, VoicePresets

__all__ = ["CosyVoice3", "DEFAULT_INSTRUCTION"]

SAMPLE_RATE = serving.SAMPLE_RATE
DEFAULT_INSTRUCTION = "You are a helpful assistant."
"""The reference's system text before ``<|endofprompt|>`` when no style instruction is given."""
MAX_INPUT_CHARS = 4096
MAX_PIECES = 64
PIECES = SentenceChunker(limit=320, first_target=120)  # English: about 80 tokens a piece
CJK_PIECES = SentenceChunker(limit=80, first_target=40)
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")


@register
class CosyVoice3(VoiceCloning, ModelSpec):
    key = "cosyvoice3"
    tasks = frozenset({"speech"})
    default_weights = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
    sample_rate = SAMPLE_RATE
    Knobs = CosyVoice3Knobs
    knobs: CosyVoice3Knobs
    takes_instructions = True  # the style instruction before <|endofprompt|>

    def graph(self) -> Graph:
        llm = Node("llm", "autoregressive", inputs=("prompt_ids", "token"), outputs=("token",),
                   ops=("prefill", "decode"), flags=("stop",))
        vocoder = Node("vocoder", "stream", inputs=("token", "prompt_speech", "prompt_mel", "xvector"),
                       outputs=("audio",))
        speak = Sequential(
            Step("llm", "prefill", reads="prompt_ids", writes="token"),
            Loop(Step("llm", "decode", reads="token", writes="token"), until="stop", max_iters="max_decode_steps"),
        )
        vocode = StreamEdge("token", into=Step("vocoder", reads=("token", "prompt_speech", "prompt_mel", "xvector"),
                                               writes="audio", emit=Emit("audio", "audio")),
                            policy=serving.HoldOne())
        inputs = ("prompt_ids", "prompt_speech", "prompt_mel", "xvector")
        return Graph.build([llm, vocoder], [Walk("tts", speak, inputs=inputs, streams=[vocode])])

    # -------------------------------------------------------------- frontend
    @property
    def dummy(self) -> bool:
        return self.config.load_format == "dummy"

    def _model_dir(self) -> str | None:
        path = self.config.model_path
        if self.dummy:
            return path
        from mstar.model.weights import resolve_model_path

        return str(resolve_model_path(path or self.default_weights, cache_dir=self.config.cache_dir))

    def load_frontend(self) -> None:
        model_dir = self._model_dir()
        self.lm_config = serving._configs(self.knobs.dummy_scale if self.dummy else "real")[0]
        self.tokenizer = serving.read_tokenizer(model_dir)
        if self.tokenizer is None:
            if not self.dummy:
                raise FileNotFoundError(f"{model_dir}: no CosyVoice-BlankEN/tokenizer.json")
            self.tokenizer = serving.ByteTokenizer()
        self.endofprompt = serving.endofprompt_of(self.tokenizer, self.lm_config)
        self.encoders = self._encoders(model_dir)
        self.presets = VoicePresets(self.knobs.voices_dir) if self.knobs.voices_dir else None

    def _encoders(self, model_dir: str | None) -> serving.ClipEncoders:
        if self.dummy:
            return serving.dummy_encoders(self.knobs.dummy_scale, self.knobs.seed)
        return serving.released_encoders(model_dir)

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    def voices(self) -> list[str]:
        return self.presets.names if getattr(self, "presets", None) else []

    def voice_list(self) -> list[Voice]:
        return self.presets.voices() if getattr(self, "presets", None) else []

    def condition_on_clip(self, samples: np.ndarray, sample_rate: int, ref_text: str | None) -> VoicePrompt:
        """The clip's speech tokens, x-vector and mel, with its transcript's ids (empty without
        one: cross-lingual cloning, where the LM gets no prompt speech, see ``_speak``)."""
        transcript = serving.text_ids(self.tokenizer, ref_text) if ref_text else []
        return serving.clip_prompt(self.encoders, samples, sample_rate, transcript)

    def prepare_speech(self, spec: SpeechSpec) -> WalkRequest | list[WalkRequest]:
        if spec.speed != 1.0:
            raise RequestError("speed", "CosyVoice3 cannot change its speaking rate; send speed 1.0")
        options = CosyVoice3SpeechKnobs.parse(spec.model_kwargs)
        return self._pieces(spec.input, self._voice(spec.voice, spec.reference), options, spec.sentence_chunking)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest | list[WalkRequest]:
        check_speech_generate(self.key, spec, clones=True)
        options = CosyVoice3GenerateKnobs.parse(spec.model_kwargs)
        return self._pieces(spec.text, self._voice(options.voice, spec.reference), options, options.sentence_chunking)

    def _voice(self, name: str | None, reference: VoiceClip | None) -> VoicePrompt:
        """The clip to clone: the uploaded one, else a preset (every request clones)."""
        if reference is not None:
            return self.clip_conditioning(reference)
        if self.presets is not None and name is not None and name in self.presets:
            return self.clip_conditioning(self.presets.clip(name))
        if name is None:
            raise RequestError("ref_audio", "CosyVoice3 clones a voice: send ref_audio (and ref_text), "
                               f"or a preset voice ({', '.join(self.voices()) or 'none configured'})")
        raise RequestError("voice", f"unknown voice {name!r}; the presets are {', '.join(self.voices()) or 'none'}")

    def _pieces(self, text: str, voice: VoicePrompt, options: CosyVoice3SpeechKnobs,
                sentence_chunking: bool | None) -> WalkRequest | list[WalkRequest]:
        """One walk per sentence piece (played in order), each cloning the same voice."""
        if not text.strip():
            raise RequestError("input", "must contain text, not only whitespace")
        if len(text) > MAX_INPUT_CHARS:
            raise RequestError("input", f"is {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
        chunking = self.knobs.sentence_chunking if sentence_chunking is None else sentence_chunking
        if not chunking:
            return self._speak(text, voice, options)
        pieces = (CJK_PIECES if _CJK.search(text) else PIECES).split(text)
        if len(pieces) > MAX_PIECES:
            raise RequestError("input", f"makes {len(pieces)} sentence pieces; the limit is {MAX_PIECES}")
        walks = [self._speak(piece, voice, options) for piece in pieces if piece.strip()]
        return walks[0] if len(walks) == 1 else walks

    def prompt_text_ids(self, voice: VoicePrompt, instructions: str | None) -> list[int]:
        """The LM's prompt text, as the reference's front end makes it. Zero-shot: the default
        system text, ``<|endofprompt|>``, the clip's transcript. With a style instruction (its
        ``instruct2`` mode): the system text and the instruction, ``<|endofprompt|>``, and no
        transcript."""
        if instructions:
            text = instructions if instructions.startswith(DEFAULT_INSTRUCTION) else \
                f"{DEFAULT_INSTRUCTION} {instructions}"
            return [*serving.text_ids(self.tokenizer, text), self.endofprompt]
        head = serving.text_ids(self.tokenizer, DEFAULT_INSTRUCTION)
        return [*head, self.endofprompt, *voice.text_ids.tolist()]

    def _speak(self, text: str, voice: VoicePrompt, options: CosyVoice3SpeechKnobs) -> WalkRequest:
        """The ``tts`` walk of one piece. Without a transcript, or with a style instruction, the
        LM is not given the clip's speech tokens (the reference's cross-lingual and instruct2
        modes); the flow always is."""
        ids = serving.text_ids(self.tokenizer, text.strip())
        if not ids:
            raise RequestError("input", "has no text tokens")
        zero_shot = voice.text_ids.numel() > 0 and not options.instructions
        lm_speech = voice.speech if zero_shot else voice.speech[:0]
        prompt = serving.lm_prompt_ids(self.lm_config, self.prompt_text_ids(voice, options.instructions) + ids,
                                       lm_speech)
        _, max_len = length_bounds(self.lm_config, len(ids))
        room = self.config.max_seq_len - prompt.shape[0]
        # the flow's noise table holds 300 s of frames, prompt included
        frames_left = serving.NOISE_FRAMES // 2 - voice.speech.shape[0]
        budget = min(options.max_tokens or max_len, max_len, room, frames_left)
        if budget < 1:
            raise RequestError("input", f"is {prompt.shape[0]} tokens with the voice prompt; max_seq_len is "
                               f"{self.config.max_seq_len}")
        params = lm_params(self.lm_config, len(ids), options.seed)
        params["min_new_tokens"] = min(params["min_new_tokens"], budget)
        inputs = {"prompt_ids": prompt, "prompt_speech": voice.speech, "prompt_mel": voice.mel,
                  "xvector": voice.xvector}
        return decode_request("tts", inputs, prompt.shape[0], budget, {}, params.pop("stop_token_ids"), self.config,
                              min_new_tokens=params["min_new_tokens"], seed=params["seed"])

    def output_stream(self, request: WalkRequest, stop: list[str]) -> PcmStream:
        return PcmStream(SAMPLE_RATE)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        cuda = device.type == "cuda"
        estimator_dtype = torch.bfloat16 if cuda and self.knobs.flow_estimator_dtype == "bfloat16" else torch.float32
        parts = serving.build_parts(self._model_dir(), dummy=self.dummy, scale=self.knobs.dummy_scale,
                                    seed=self.knobs.seed, device=device,
                                    lm_dtype=self.config.torch_dtype() if cuda else torch.float32,
                                    estimator_dtype=estimator_dtype)
        engines = {}
        if "llm" in nodes:
            engines["llm"] = decode_engine(parts.lm, self.knobs, self.config, device, RasRules())
        if "vocoder" in nodes:
            engines["vocoder"] = serving.VocodeEngine(parts.flow, parts.hift, parts.lm.config.speech_token_size)
        return engines
