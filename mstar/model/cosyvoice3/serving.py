"""What the served family needs beyond the model parts: the parts at the released or tiny
shapes (``load_format: dummy``), the voice prompt of a clip, and the vocoder node of the graph.

The vocoder node (``VocodeEngine``) consumes the LM's token stream chunk by chunk. It keeps, per
request, the state ``synthesis.stream_audio`` keeps in its loop (the tokens so far, a
``StreamPlanner``, the mel so far and the samples already sent), so a request's joined audio
is exactly the plain walk's, whatever the chunking of its token stream: the planner, not the
stream edge, decides when the flow runs. Silent-token runs past five are dropped here, as the
plain walk's LM driver drops them, and stop ids never reach the flow.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from mstar.contract import RequestError
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.graph.chunking import Chunk, ChunkPolicy
from mstar.model.cosyvoice3.checkpoint import (
    CosyVoice3Parts,
    build_flow,
    load_parts,
    load_speaker_encoder,
    load_speech_tokenizer,
)
from mstar.model.cosyvoice3.dit import DiTConfig
from mstar.model.cosyvoice3.flow import CosyVoice3Flow, FlowConfig, StreamPlanner
from mstar.model.cosyvoice3.lm import SpeechLM, SpeechLMConfig
from mstar.model.cosyvoice3.qwen2 import qwen2_config
from mstar.model.cosyvoice3.synthesis import SILENT_TOKENS, VoicePrompt
from mstar.model.s3gen.mel import MelConfig, log_mel
from mstar.model.speech_front.campplus import CampPlus, CampPlusConfig
from mstar.model.speech_front.s3_tokenizer import S3Tokenizer, S3TokenizerConfig
from mstar.model.vocoder import HiFTConfig, HiFTGenerator
from mstar.model.weights import building, init_dummy_weights

__all__ = ["ClipEncoders", "HoldOne", "Scale", "VocodeEngine", "build_parts", "clip_prompt", "dummy_encoders",
           "released_encoders"]

Scale = Literal["real", "tiny"]
SAMPLE_RATE = 24000
S3_RATE = 16000
MAX_PROMPT_SECONDS = 30
NOISE_FRAMES = 50 * 300  # the flow's fixed noise table (``noise_table``): 300 s of mel frames
MEL = MelConfig(fmax=SAMPLE_RATE / 2)
"""CosyVoice3's ``feat_extractor``: CosyVoice2's 24 kHz mel with ``fmax: null`` (the Nyquist)."""

QWEN2_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=32768, tie_word_embeddings=True)
TINY_QWEN2 = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
TINY_END_OF_PROMPT = 255
"""The tiny LM's ``<|endofprompt|>`` id (its text vocabulary is the 255 byte values, see ``ByteTokenizer``)."""


@dataclass(frozen=True)
class ClipEncoders:
    """The front ends of a reference clip (CosyVoice3 ships both as ONNX files, read into these
    modules: see docs/speech_front.md)."""

    tokenizer: S3Tokenizer
    campplus: CampPlus


def _configs(scale: Scale) -> tuple[SpeechLMConfig, FlowConfig, HiFTConfig]:
    if scale == "real":
        return (SpeechLMConfig(backbone=qwen2_config(QWEN2_0_5B)), FlowConfig(), HiFTConfig(causal=True))
    lm = SpeechLMConfig(backbone=qwen2_config(TINY_QWEN2), endofprompt_id=TINY_END_OF_PROMPT)
    dit = DiTConfig(dim=32, depth=2, heads=4, head_dim=8, static_chunk_size=8)
    flow = FlowConfig(speaker_dim=16, lookahead_channels=24, dit=dit)
    hift = HiFTConfig(base_channels=32, upsample_rates=(8, 5, 3), upsample_kernel_sizes=(16, 11, 7), n_fft=16,
                      hop_length=4, resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),),
                      source_resblock_kernel_sizes=(3, 3, 3), source_resblock_dilation_sizes=((1,), (1,), (1,)),
                      f0_cond_channels=16, causal=True)
    return lm, flow, hift


def build_parts(model_dir: str | None, *, dummy: bool, scale: Scale = "real", seed: int = 0,
                device: torch.device | str = "cpu", lm_dtype: torch.dtype = torch.float32,
                estimator_dtype: torch.dtype = torch.float32) -> CosyVoice3Parts:
    """The LM, flow and causal HiFT: from a Fun-CosyVoice3 directory, or seeded random weights
    at the released (``real``) or tiny shapes. The LM is made on ``device`` in ``lm_dtype``, the
    flow in float32 with its DiT in ``estimator_dtype`` (``checkpoint.build_flow``), each in its
    dtype at once, and the dummy weights drawn there. The dummy LM's stop logits are scaled
    down, so a random LM speaks for a while instead of stopping at its minimum length."""
    lm_config, flow_config, hift_config = _configs(scale)
    if not dummy:
        if model_dir is None:
            raise ValueError("cosyvoice3 needs model_path (a Fun-CosyVoice3-0.5B directory)")
        return load_parts(model_dir, flow=flow_config, hift=hift_config, device=device, lm_dtype=lm_dtype,
                          estimator_dtype=estimator_dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)  # HiFT keeps torch's own init: 0.02-std weights would make it silent
        hift = HiFTGenerator(hift_config)  # float32, on the CPU: torch's init draws from the CPU generator
    with building(device, lm_dtype):
        lm = SpeechLM(lm_config)
    parts = CosyVoice3Parts(lm, build_flow(flow_config, device, estimator_dtype), hift)
    for i, module in enumerate((parts.lm, parts.flow)):
        init_dummy_weights(module, seed=seed + i)
    with torch.no_grad():
        parts.lm.llm_decoder.weight[lm_config.speech_token_size:] *= 0.1
        parts.hift.f0_predictor.classifier.bias.fill_(100.0)  # voiced: F0 near 100 Hz
    parts.hift.to(device)
    for module in (parts.lm, parts.flow, parts.hift):
        module.eval()
    return parts


def released_encoders(model_dir: str | None) -> ClipEncoders:
    """The front ends of a Fun-CosyVoice3 directory (its two ONNX files)."""
    if model_dir is None:
        raise ValueError("cosyvoice3 needs model_path (a Fun-CosyVoice3-0.5B directory)")
    return ClipEncoders(load_speech_tokenizer(model_dir), load_speaker_encoder(model_dir))


def dummy_encoders(scale: Scale, seed: int = 0) -> ClipEncoders:
    """Seeded random front ends (S3 tokenizer v3 and CAM++) at the released or tiny shapes."""
    if scale == "real":
        tokenizer, campplus = S3Tokenizer(S3TokenizerConfig.v3()), CampPlus(CampPlusConfig())
    else:
        tokenizer = S3Tokenizer(S3TokenizerConfig(d_model=64, n_heads=1, n_layers=1))
        campplus = CampPlus(CampPlusConfig(embedding_size=16, growth_rate=8, init_channels=16, head_channels=8,
                                           block_layers=(1, 1, 1)))
    for i, module in enumerate((tokenizer, campplus)):
        init_dummy_weights(module, seed=seed + 10 + i)
        module.eval()
    return ClipEncoders(tokenizer, campplus)


@torch.no_grad()
def clip_prompt(encoders: ClipEncoders, samples: np.ndarray, sample_rate: int, text_ids: list[int]) -> VoicePrompt:
    """The ``VoicePrompt`` of a clip (mono float32 at ``sample_rate``), as the reference's front
    end builds it: S3 tokens v3 and the CAM++ x-vector of the 16 kHz clip, the 24 kHz mel, then
    tokens and mel cut to the same length (two frames a token). ``text_ids``: the instruction,
    ``<|endofprompt|>`` and the transcript, already tokenised."""
    from mstar.audio.io import resample

    seconds = samples.size / sample_rate
    if seconds > MAX_PROMPT_SECONDS:
        raise RequestError("ref_audio", f"the clip is {seconds:.1f} s; CosyVoice3 takes at most "
                           f"{MAX_PROMPT_SECONDS} s (a few seconds clone best)")
    wave16 = torch.from_numpy(resample(samples.astype(np.float32), sample_rate, S3_RATE).copy())
    wave24 = torch.from_numpy(resample(samples.astype(np.float32), sample_rate, SAMPLE_RATE).copy())
    if wave16.numel() < S3_RATE // 4:
        raise RequestError("ref_audio", f"the clip is {seconds:.2f} s; CosyVoice3 needs at least 0.25 s")
    tokens, counts = encoders.tokenizer([wave16])
    speech = tokens[0, : int(counts[0])].long()
    xvector = encoders.campplus([wave16])[0].float()
    mel = log_mel(wave24, MEL)[0].transpose(0, 1)  # [frames, 80]
    n = min(mel.shape[0] // 2, speech.shape[0])
    if n < 1:
        raise RequestError("ref_audio", "the clip holds no speech token")
    return VoicePrompt(torch.tensor(text_ids, dtype=torch.long), speech[:n].clone(), mel[: 2 * n].clone(), xvector)


class HoldOne(ChunkPolicy):
    """Every new token but the newest while the LM runs; the rest, marked last, once it stops.
    Holding one back makes sure the last chunk is never empty, so the vocoder always sees the
    end of the stream (it must run the flow's final call then)."""

    def next_chunk(self, available, taken, covered, closed):
        end = available if closed else available - 1
        if end <= covered:
            return None
        return Chunk(taken, covered, end, covered, end, closed)


@dataclass
class _Stream:
    planner: StreamPlanner
    prompt: VoicePrompt
    received: list[int]
    mel: torch.Tensor | None = None
    sent: int = 0
    silent_run: int = 0


class VocodeEngine(Engine):
    """The ``vocoder`` node: speech tokens in, 24 kHz samples out, per request state as the
    module doc says. Requests run one after another (each flow call covers a different
    number of tokens, so rows would rarely share a shape)."""

    def __init__(self, flow: CosyVoice3Flow, hift: HiFTGenerator, speech_token_size: int,
                 max_silent_run: int = 5) -> None:
        self.flow, self.hift = flow, hift
        self.speech_token_size = speech_token_size
        self.max_silent_run = max_silent_run
        self.hop = flow.config.dit.static_chunk_size // flow.config.token_mel_ratio
        self.streams: dict[str, _Stream] = {}

    def _start(self, item: EngineItem) -> _Stream:
        prompt = VoicePrompt(torch.zeros(0, dtype=torch.long), item.inputs["prompt_speech"].long().cpu(),
                             item.inputs["prompt_mel"].float().cpu(), item.inputs["xvector"].float().cpu())
        planner = StreamPlanner(prompt_tokens=prompt.speech.shape[0], lookahead=self.flow.config.lookahead,
                                hop=self.hop, max_hop=4 * self.hop)
        return _Stream(planner, prompt, [])

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        return [EngineOutput({"audio": self._step(item)}) for item in items]

    @torch.inference_mode()
    def _step(self, item: EngineItem) -> torch.Tensor:
        state = self.streams.get(item.request_id) or self.streams.setdefault(item.request_id, self._start(item))
        for token in item.inputs["token"].reshape(-1).tolist():
            if token >= self.speech_token_size:
                continue
            state.silent_run = state.silent_run + 1 if token in SILENT_TOKENS else 0
            if state.silent_run <= self.max_silent_run:
                state.received.append(int(token))
        last = bool(item.chunk is not None and item.chunk.last)
        pieces = []
        while (chunk := state.planner.next_chunk(len(state.received), finished=last)) is not None:
            pieces.append(self._run_chunk(state, chunk))
        if last:
            self.streams.pop(item.request_id, None)
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def _run_chunk(self, state: _Stream, chunk) -> torch.Tensor:
        from mstar.model.cosyvoice3.synthesis import _flow_call

        new = _flow_call(self.flow, state.received[: chunk.tokens], state.prompt, chunk.finalize)
        new = new[..., chunk.offset * self.flow.config.token_mel_ratio:]
        state.mel = new if state.mel is None else torch.cat([state.mel, new], dim=-1)
        wave, _ = self.hift(state.mel, finalize=chunk.finalize)
        piece = wave[0, state.sent:].float().cpu()
        state.sent += piece.shape[0]
        return piece

    def release(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return {"vocoder_streams": float(len(self.streams))}


def read_tokenizer(model_dir: str | None):
    """The checkpoint's Qwen2 text tokenizer (``CosyVoice-BlankEN/``, or ``tokenizer.json`` in
    the directory itself), or None when neither is there."""
    if model_dir is None:
        return None
    root = Path(model_dir)
    for where in (root / "CosyVoice-BlankEN", root):
        if (where / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(where / "tokenizer.json"))
    return None


class ByteTokenizer:
    """The dummy deployment's text tokenizer when the directory has none: a UTF-8 byte is its
    own id (the tiny LM's text vocabulary), so ``load_format: dummy`` starts without files."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with either tokenizer (``tokenizers.Tokenizer`` or ``ByteTokenizer``)."""
    out = tokenizer.encode(text)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def endofprompt_of(tokenizer, config: SpeechLMConfig) -> int:
    """The ``<|endofprompt|>`` id: the tokenizer's own when it knows the token, else the config's."""
    if hasattr(tokenizer, "token_to_id"):
        found = tokenizer.token_to_id("<|endofprompt|>")
        if found is not None:
            return int(found)
    assert config.endofprompt_id is not None
    return config.endofprompt_id


def lm_prompt_ids(config: SpeechLMConfig, text: list[int], speech: torch.Tensor) -> torch.Tensor:
    """``SpeechLM.prompt_ids`` from the config alone (the API server holds no LM): CosyVoice3's
    layout, ``sos``, the text ids past the speech vocabulary, ``task``, the prompt's speech."""
    if config.layout != "cosyvoice3":
        raise ValueError("the served family speaks CosyVoice3's layout only")
    sos, task = config.speech_token_size, config.speech_token_size + 2
    text_ids = torch.tensor(text, dtype=torch.long) + config.speech_vocab
    return torch.cat([torch.tensor([sos]), text_ids, torch.tensor([task]), speech.long()])


def tiny_configs() -> tuple[SpeechLMConfig, FlowConfig, HiFTConfig]:
    """The tiny shapes (tests, CI)."""
    return _configs("tiny")


