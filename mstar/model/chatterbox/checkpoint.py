"""A whole Chatterbox checkpoint directory: T3, S3Gen, the three clip encoders, the built-in
voice and the text front, or seeded dummy weights at the released (or tiny) shapes.

A released directory (``ResembleAI/chatterbox``, ``ResembleAI/chatterbox-turbo``) holds:

* the variant's T3 (``t3_cfg`` / ``t3_mtl23ls_v2`` / ``t3_turbo_v1.safetensors``, ``load_t3``)
  and its tokenizer files (``T3TextFront``);
* ``s3gen.safetensors`` (Turbo: ``s3gen_meanflow.safetensors``): S3Gen under ``flow.`` and
  ``mel2wav.``, and the clip encoders S3Gen's reference keeps beside it, the S3 tokenizer
  under ``tokenizer.`` and CAMPPlus under ``speaker_encoder.``;
* ``ve.safetensors``: the voice encoder (T3's speaker embedding);
* ``conds.pt``: the built-in voice, already encoded (``BuiltinVoice``).

Each module's loader checks coverage both ways; here they are only put together. Under
``load_format: dummy`` nothing is read: the weights are seeded random, the built-in voice is
random too, and the text front maps characters to ids (``CharTextFront``) unless the directory
has the tokenizer files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from mstar.model.chatterbox.config import GPT2Config, PerceiverConfig, T3Config
from mstar.model.chatterbox.t3 import T3
from mstar.model.chatterbox.t3_checkpoint import TEXT_FILES, T3TextFront, load_t3
from mstar.model.chatterbox.text import t3_text_ids
from mstar.model.flow import EstimatorConfig, FlowFrontConfig
from mstar.model.llama.config import LlamaConfig
from mstar.model.perth import PerthConfig, PerthNet, load_perth
from mstar.model.s3gen import S3GEN_FILES, EncoderConfig, S3Gen, S3GenConfig, S3GenPrompt, read_s3gen
from mstar.model.speech_front import (
    CampPlus,
    CampPlusConfig,
    S3Tokenizer,
    S3TokenizerConfig,
    VoiceEncoder,
    VoiceEncoderConfig,
    campplus_name_map,
    s3_tokenizer_name_map,
    voice_encoder_name_map,
)
from mstar.model.vocoder import HiFTConfig
from mstar.model.weights import fill_weights, init_dummy_weights

__all__ = ["BuiltinVoice", "ChatterboxCheckpoint", "ClipEncoders", "CharTextFront", "TextFront", "Voice"]

VE_FILE = "ve.safetensors"
CONDS_FILE = "conds.pt"
TINY_S3GEN_STD = 0.1  # tiny dummy S3Gen: audio peaks near 0.04, audible as int16 and unclipped


@dataclass(frozen=True)
class Voice:
    """One voice, as T3 and S3Gen read it: T3's ``speaker_emb [1, S]`` and ``prompt_tokens
    [1, P]`` (the exaggeration is the request's), and S3Gen's prompt (tokens, mel, x-vector).
    Shared by every request in that voice: never mutate it."""

    speaker_emb: torch.Tensor
    prompt_tokens: torch.Tensor
    s3gen: S3GenPrompt


BuiltinVoice = Voice


class TextFront(Protocol):
    def ids(self, text: str, language: str | None = None) -> list[int]: ...


class CharTextFront:
    """Dummy weights' text front, for a directory without tokenizer files: each character's
    code point folded into the text vocabulary (ids 1 .. vocab - 1, clear of the markers a
    tiny vocabulary may put at 0), with the variant's start / stop tokens around. It makes
    plausible ids, not language."""

    def __init__(self, config: T3Config) -> None:
        self.config = config

    def ids(self, text: str, language: str | None = None) -> list[int]:
        span = self.config.text_vocab_size - 2
        return t3_text_ids([1 + ord(c) % span for c in text], self.config)


@dataclass
class ClipEncoders:
    """What a reference clip goes through (API-server side): the voice encoder, the S3
    tokenizer and CAMPPlus."""

    voice_encoder: VoiceEncoder
    tokenizer: S3Tokenizer
    campplus: CampPlus


# ----------------------------------------------------------------------------- tiny configs
def tiny_t3_config(variant: str) -> T3Config:
    """A small T3 of the variant with the released speech-token layout (S3 codes below 6561),
    so that a clip's S3 tokens are valid prompt ids."""
    common = dict(max_text_tokens=420, max_speech_tokens=160, speaker_embed_size=tiny_ve_config().embed_size,
                  speech_cond_prompt_len=6, text_vocab_size=64, start_text_token=63, stop_text_token=0)
    if variant == "turbo":
        gpt2 = GPT2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                          vocab_size=8)
        return T3Config(variant="turbo", backbone=gpt2, speech_vocab_size=6563, learned_positions=False,
                        perceiver=None, emotion_adv=False, **common)
    llama = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                        rope_theta=500000.0, max_position_embeddings=4096)
    heads = ((1, 3), (0, 1), (1, 0)) if variant == "multilingual" else ()
    return T3Config(variant=variant, backbone=llama, perceiver=PerceiverConfig(queries=4, heads=4),
                    alignment_heads=heads, **common)


def tiny_s3gen_config(meanflow: bool) -> S3GenConfig:
    width = 16
    return S3GenConfig(
        front=FlowFrontConfig(vocab_size=6561, token_dim=width, encoder_dim=width,
                              speaker_dim=tiny_campplus_config().embedding_size),
        encoder=EncoderConfig(width=width, heads=2, ffn_width=24, blocks=2),
        estimator=EstimatorConfig(channels=(8,), num_heads=2, head_dim=8, blocks_per_level=1, mid_levels=1,
                                  meanflow=meanflow),
        vocoder=HiFTConfig(base_channels=16, f0_cond_channels=16, upsample_rates=(8, 5, 3),
                           upsample_kernel_sizes=(16, 11, 7), per_sample_source=True),
        n_cfm_timesteps=2 if meanflow else 4,
    )


def tiny_ve_config() -> VoiceEncoderConfig:
    return VoiceEncoderConfig(hidden_size=16, embed_size=8, num_layers=1)


def tiny_campplus_config() -> CampPlusConfig:
    return CampPlusConfig(embedding_size=16, growth_rate=4, bn_size=2, init_channels=16)


def tiny_tokenizer_config() -> S3TokenizerConfig:
    return S3TokenizerConfig(d_model=128, n_heads=2, n_layers=1)


def tiny_perth_config() -> PerthConfig:
    return PerthConfig(n_fft=256, hop=40, hidden=8)


# ----------------------------------------------------------------------------- checkpoint
def _tensors(path: Path):
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _file(directory: Path, name: str) -> Path:
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a Chatterbox checkpoint directory has {name}")
    return path


class ChatterboxCheckpoint:
    """The parts of one variant from ``directory`` or, with ``dummy``, seeded at the released
    (``tiny=False``) or tiny shapes. ``directory`` may be None under dummy."""

    def __init__(self, directory: str | Path | None, variant: str, *, dummy: bool = False, tiny: bool = False,
                 seed: int = 0) -> None:
        if directory is None and not dummy:
            raise ValueError("a Chatterbox checkpoint directory is needed unless load_format is dummy")
        self.directory = Path(directory) if directory is not None else None
        self.variant = variant
        self.dummy, self.tiny, self.seed = dummy, dummy and tiny, seed
        self.meanflow = variant == "turbo"

    # configs
    def t3_config(self) -> T3Config:
        return tiny_t3_config(self.variant) if self.tiny else T3Config.for_variant(self.variant)

    def s3gen_config(self) -> S3GenConfig:
        if self.tiny:
            return tiny_s3gen_config(self.meanflow)
        return S3GenConfig.turbo() if self.meanflow else S3GenConfig()

    def ve_config(self) -> VoiceEncoderConfig:
        return tiny_ve_config() if self.tiny else VoiceEncoderConfig()

    def tokenizer_config(self) -> S3TokenizerConfig:
        return tiny_tokenizer_config() if self.tiny else S3TokenizerConfig()

    def campplus_config(self) -> CampPlusConfig:
        return tiny_campplus_config() if self.tiny else CampPlusConfig()

    # worker side
    def t3(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> T3:
        return load_t3(self.directory, self.t3_config(), device=device, dtype=dtype, dummy=self.dummy,
                       seed=self.seed)

    def s3gen(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> S3Gen:
        if not self.dummy:
            return read_s3gen(self.directory, self.s3gen_config()).to(device, dtype)
        model = S3Gen(self.s3gen_config())
        fill_weights(model, lambda: iter(()), dummy=True, seed=self.seed + 1)
        if self.tiny:  # at the usual std the tiny vocoder says ~1e-5, below 16-bit PCM's step
            init_dummy_weights(model, seed=self.seed + 1, std=TINY_S3GEN_STD)
        return model.to(device, dtype).eval()

    def perth(self, path: str | None, device: torch.device | str = "cpu") -> PerthNet | None:
        """PerTh's network: seeded under dummy, else from ``path`` (None: no watermark)."""
        if self.dummy:
            net = PerthNet(tiny_perth_config() if self.tiny else PerthConfig())
            fill_weights(net, lambda: iter(()), dummy=True, seed=self.seed + 2)
            return net.to(device).eval()
        if path is None:
            return None
        net = PerthNet(PerthConfig())
        load_perth(net, torch.load(path, map_location="cpu", weights_only=True)["model"].items())
        return net.to(device).eval()

    # API-server side
    def clip_encoders(self) -> ClipEncoders:
        """The voice encoder, S3 tokenizer and CAMPPlus, on the CPU in float32."""
        ve = VoiceEncoder(self.ve_config())
        tok = S3Tokenizer(self.tokenizer_config())
        cam = CampPlus(self.campplus_config())
        if self.dummy:
            for i, module in enumerate((ve, tok, cam)):
                fill_weights(module, lambda: iter(()), dummy=True, seed=self.seed + 3 + i)
        else:
            s3gen_file = _file(self.directory, S3GEN_FILES[self.meanflow])
            fill_weights(ve, lambda: _tensors(_file(self.directory, VE_FILE)), dummy=False, seed=0,
                         name_map=voice_encoder_name_map())
            fill_weights(tok, lambda: _tensors(s3gen_file), dummy=False, seed=0,
                         name_map=s3_tokenizer_name_map("tokenizer."))
            fill_weights(cam, lambda: _tensors(s3gen_file), dummy=False, seed=0,
                         name_map=campplus_name_map("speaker_encoder."))
        return ClipEncoders(ve, tok, cam)

    def builtin_voice(self) -> Voice:
        """``conds.pt``'s voice, or under dummy a seeded random one (3 s of prompt)."""
        if self.dummy:
            return self._dummy_voice()
        conds = torch.load(_file(self.directory, CONDS_FILE), map_location="cpu", weights_only=True)
        t3, gen = conds["t3"], conds["gen"]
        prompt = S3GenPrompt.aligned(gen["prompt_token"].long().reshape(1, -1), gen["prompt_feat"].float(),
                                     gen["embedding"].float().reshape(1, -1))
        tokens = t3["cond_prompt_speech_tokens"]
        tokens = torch.zeros(1, 0, dtype=torch.long) if tokens is None else tokens.long().reshape(1, -1)
        return Voice(t3["speaker_emb"].float().reshape(1, -1), tokens, prompt)

    def _dummy_voice(self) -> Voice:
        g = torch.Generator().manual_seed(self.seed + 7)
        t3, s3 = self.t3_config(), self.s3gen_config()
        speaker = torch.randn(1, t3.speaker_embed_size, generator=g)
        prompt_tokens = torch.randint(0, 6561, (1, min(t3.speech_cond_prompt_len, 75)), generator=g)
        s3_tokens = torch.randint(0, s3.front.vocab_size, (1, 75), generator=g)
        mel = torch.randn(1, 150, s3.front.mel_channels, generator=g) - 5.0
        xvector = torch.randn(1, s3.front.speaker_dim, generator=g)
        return Voice(speaker / speaker.norm(), prompt_tokens, S3GenPrompt(s3_tokens, mel, xvector))

    def text_front(self) -> TextFront:
        """The tokenizer files' front; under dummy without them, ``CharTextFront``."""
        config = self.t3_config()
        if self.dummy and not self._has_tokenizer():
            return CharTextFront(config)
        return T3TextFront(self.directory, config)

    def _has_tokenizer(self) -> bool:
        if self.directory is None:
            return False
        names = {"turbo": ("tokenizer.json", "vocab.json")}.get(self.variant, (TEXT_FILES[self.variant],))
        return any((self.directory / n).is_file() for n in names)
