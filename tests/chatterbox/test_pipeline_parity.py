"""The whole served utterance against the reference package's own top-level ``generate``.

``record_pipeline.py`` ran ``ChatterboxTTS.generate`` / ``ChatterboxMultilingualTTS.generate``
/ ``ChatterboxTurboTTS.generate`` (chatterbox-tts 0.1.7, s3tokenizer 0.3.0, conformer 0.3.2,
resemble-perth 1.0.1, librosa 0.11.0, transformers 5.2.0, torchaudio 2.11.0's Python code, on
torch 2.13.0+cpu) on a tiny random model at the package's default options, and kept the
checkpoint in the released file layout (float16 values: the reference ran on exactly what
they load as). Here our loader reads that directory (the sizes are tiny, so the configs are
the record's), an in-process deployment speaks the same text with the same seed, and:

* T3's drawn tokens equal the reference's, stop token included, at the package's own
  temperature 0.8 (not a greedy stand-in): the reference draws with ``torch.multinomial``
  from the global generator seeded with the seed, and our decode draws the same way from a
  generator seeded alike, so the streams are one stream;
* the waveform (after the PerTh watermark, the tiny network of ``tests/perth``) is within
  1e-4 of the reference's peak, and so is the unmarked one that S3Gen handed to PerTh. The
  reference draws S3Gen's noise on from where T3's sampling left the global generator; we
  seed a fresh generator for S3Gen from the request's seed, so the recording re-seeded the
  global generator as ``s3gen.inference`` started (the only change to the reference's path).

The tiny T3 has 63 speech ids (start 61, stop 62) where the released one has 6563: the
recording renames 61 / 62 to the released 6561 / 6562 on their way out of ``t3.inference``,
so the package's own filters (``drop_invalid_tokens``, ``< 6561``) see them as they would.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.config import parse_config
from mstar.contract import SamplingParams, SpeechSpec
from mstar.model.chatterbox import checkpoint as ckpt
from mstar.model.chatterbox.conditioning import T3Conditioning
from mstar.model.chatterbox.config import GPT2Config, PerceiverConfig, T3Config
from mstar.model.chatterbox.model import SAMPLING_DEFAULTS
from mstar.model.chatterbox.synthesis import clip_voice
from mstar.model.chatterbox.t3_decode import PagedSequences, T3Request, generate, speech_tokens_for_s3gen
from mstar.model.llama.config import LlamaConfig
from mstar.model.perth import PerthConfig
from mstar.model.speech_front import CampPlusConfig, S3TokenizerConfig, VoiceEncoderConfig
from mstar.model.speech_output import pcm_to_array
from mstar.runtime.launch import start
from tests.chatterbox.tiny import FIXTURES
from tests.s3gen import record_reference as s3rec
from tests.s3gen.tiny import s3gen_config

KEYS = {"english": "chatterbox", "multilingual": "chatterbox_multilingual", "turbo": "chatterbox_turbo"}
PERTH = torch.load(Path(__file__).parents[1] / "perth" / "fixtures" / "tiny.pt")["config"]


def record(variant: str) -> dict:
    return torch.load(FIXTURES / f"pipeline_{variant}" / "record.pt")


def t3_config(variant: str, sizes: dict) -> T3Config:
    common = dict(text_vocab_size=sizes["text_vocab"], start_text_token=sizes["start_text"],
                  stop_text_token=sizes["stop_text"], speech_vocab_size=sizes["speech_vocab"],
                  start_speech_token=sizes["start_speech"], stop_speech_token=sizes["stop_speech"],
                  max_text_tokens=sizes["max_text"], max_speech_tokens=sizes["max_speech"],
                  speaker_embed_size=sizes["speaker"], speech_cond_prompt_len=sizes["prompt_len"])
    if variant == "turbo":
        gpt2 = GPT2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1100,
                          vocab_size=8)
        return T3Config(variant="turbo", backbone=gpt2, learned_positions=False, perceiver=None, emotion_adv=False,
                        **common)
    llama = LlamaConfig(
        vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling=dict(rope_type="llama3", factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192))
    heads = ((1, 3), (0, 1), (1, 0)) if variant == "multilingual" else ()
    return T3Config(variant=variant, backbone=llama, perceiver=PerceiverConfig(queries=sizes["perceiver_queries"],
                                                                               heads=4),
                    alignment_heads=heads, **common)


def tiny_sizes(monkeypatch, variant: str, sizes: dict) -> None:
    """Our checkpoint reader at the recording's tiny sizes (it knows the released ones only)."""
    s3 = s3gen_config(dict(encoder=s3rec.ENCODER, estimator=s3rec.ESTIMATOR, hift=s3rec.HIFT,
                           f0_channels=s3rec.F0_CHANNELS, vocab=sizes["s3gen_vocab"],
                           speaker=sizes["campplus"]["embedding_size"], meanflow=variant == "turbo"))
    tok = sizes["tokenizer"]
    monkeypatch.setattr(ckpt.ChatterboxCheckpoint, "t3_config", lambda self: t3_config(variant, sizes))
    monkeypatch.setattr(ckpt.ChatterboxCheckpoint, "s3gen_config", lambda self: s3)
    monkeypatch.setattr(ckpt.ChatterboxCheckpoint, "ve_config",
                        lambda self: VoiceEncoderConfig(hidden_size=sizes["ve_hidden"], embed_size=sizes["speaker"]))
    monkeypatch.setattr(ckpt.ChatterboxCheckpoint, "tokenizer_config", lambda self: S3TokenizerConfig(
        d_model=tok["n_audio_state"], n_heads=tok["n_audio_head"], n_layers=tok["n_audio_layer"]))
    monkeypatch.setattr(ckpt.ChatterboxCheckpoint, "campplus_config",
                        lambda self: CampPlusConfig(**sizes["campplus"]))
    monkeypatch.setattr(ckpt, "PerthConfig", lambda: PerthConfig(
        sample_rate=PERTH["sample_rate"], n_fft=PERTH["n_fft"], hop=PERTH["hop_size"], hidden=PERTH["hidden_size"],
        max_wmark_freq=PERTH["max_wmark_freq"], magnitude_floor=PERTH["stft_magnitude_min"]))


def checkpoint_dir(variant: str, root: Path) -> Path:
    """The variant's directory as released: float32 tensors (the fixture stores their float16
    values), the files it shares with English's copied in, and Turbo's clip encoders
    (English's, by construction) put back into its S3Gen file."""
    from safetensors.torch import load_file, save_file

    target = root / variant
    shutil.copytree(FIXTURES / f"pipeline_{variant}", target)
    english = FIXTURES / "pipeline_english"
    for name in ("s3gen.safetensors", "ve.safetensors", "clip.wav") if variant == "multilingual" else \
            ("ve.safetensors", "clip.wav") if variant == "turbo" else ():
        shutil.copy(english / name, target / name)
    if variant == "turbo":
        shared = {k: v for k, v in load_file(english / "s3gen.safetensors").items()
                  if k.startswith(("tokenizer.", "speaker_encoder."))}
        path = target / "s3gen_meanflow.safetensors"
        save_file(load_file(path) | shared, str(path))
    for path in target.glob("*.safetensors"):
        save_file({k: v.float() if v.is_floating_point() else v for k, v in load_file(path).items()}, str(path))
    return target


def speak(variant: str, directory: Path, rec: dict) -> np.ndarray:
    options = {"seed": rec["seed"], "language_id": rec["language"]} if rec["language"] else {"seed": rec["seed"]}
    config = {"model": KEYS[variant], "model_path": str(directory), "device": "cpu", "max_concurrent_requests": 2,
              "node_groups": [{"node_names": ["t3", "s3gen"], "ranks": [0]}],
              "model_kwargs": {"max_new_tokens_limit": rec["sizes"]["max_speech"],
                               "perth_path": str(directory / "perth.pt")}}
    deployment = start(parse_config(config), in_process=True)
    try:
        async def run():
            return [e async for e in deployment.backend.speech(SpeechSpec("p", rec["text"], None, 1.0, options))]

        return pcm_to_array(asyncio.run(run()))
    finally:
        deployment.close()


@pytest.mark.parametrize("variant", list(KEYS))
def test_served_utterance_equals_the_packages_generate(variant, monkeypatch, tmp_path):
    rec = record(variant)
    tiny_sizes(monkeypatch, variant, rec["sizes"])
    directory = checkpoint_dir(variant, tmp_path)
    got = speak(variant, directory, rec)
    want = rec["wave"].numpy()
    peak = float(np.abs(want).max())
    assert got.shape == want.shape, (got.shape, want.shape)
    error = float(np.abs(got - want).max())
    assert error <= 1e-4 * peak, f"max error {error:.3g}, peak {peak:.3g}"


@pytest.mark.parametrize("variant", list(KEYS))
def test_t3_draws_the_packages_tokens(variant, monkeypatch, tmp_path):
    """Our T3 decode (the one the ``t3`` node runs) on the loaded checkpoint, the text ids of
    our text front and the built-in voice of ``conds.pt``: the same tokens as the package's
    ``generate`` drew, and the same ones handed to S3Gen."""
    rec = record(variant)
    tiny_sizes(monkeypatch, variant, rec["sizes"])
    parts = ckpt.ChatterboxCheckpoint(checkpoint_dir(variant, tmp_path), variant)
    t3, config, voice = parts.t3(), parts.t3_config(), parts.builtin_voice()
    ids = parts.text_front().ids(rec["text"], rec["language"])
    sampling = SamplingParams(**SAMPLING_DEFAULTS[variant], seed=rec["seed"])
    cfg = 0.5 if config.guided else 0.0
    request = T3Request(T3Conditioning(voice.speaker_emb, voice.prompt_tokens, 0.5), torch.tensor(ids), sampling,
                        cfg, rec["sizes"]["max_speech"])
    tokens = list(generate(t3, request, PagedSequences(t3), torch.Generator().manual_seed(rec["seed"])).tokens)
    assert speech_tokens_for_s3gen(tokens, config) == rec["s3gen_tokens"].tolist()
    if config.is_gpt2 and tokens[-1] == config.stop_speech_token:
        tokens = tokens[:-1]  # Turbo's reference drops the stop token before returning
    assert tokens == rec["tokens"].tolist()


def test_a_cloned_clip_conditions_close_to_the_package():
    """``clip_voice`` of ``clip.wav`` against the package's ``prepare_conditionals`` of it (the
    record's ``clip_conds``, before the recording folded the codes into the tiny vocabularies).
    The package resamples 24 -> 16 kHz with librosa (soxr) and torchaudio's sinc filter, ours
    with one polyphase filter, so this is close, not equal: the S3Gen prompt mel (24 kHz, no
    resampling) is equal, the 16 kHz encoders' embeddings are near, and the S3 codes mostly
    agree (measured: 148 of 150 for S3Gen's prompt, 5 of 6 for T3's; on the package's own
    16 kHz samples ours gives its codes exactly). A cloned voice is therefore not served
    token for token like the package's."""
    import soundfile

    rec = record("english")
    sizes = rec["sizes"]
    directory = FIXTURES / "pipeline_english"
    mp = pytest.MonkeyPatch()
    try:
        tiny_sizes(mp, "english", sizes)
        parts = ckpt.ChatterboxCheckpoint(directory, "english")
        encoders, config = parts.clip_encoders(), parts.t3_config()
    finally:
        mp.undo()
    samples, rate = soundfile.read(str(directory / "clip.wav"), dtype="float32")
    voice = clip_voice(encoders, samples, rate, config)
    want = rec["clip_conds"]
    mel = want["gen"]["prompt_feat"]
    assert voice.s3gen.mel.shape == mel.shape
    assert float((voice.s3gen.mel - mel).abs().max()) < 1e-4 * float(mel.abs().max())
    cos = torch.nn.functional.cosine_similarity
    with torch.no_grad():
        assert float(cos(voice.speaker_emb, want["speaker"]).min()) > 0.99
        assert float(cos(voice.s3gen.xvector, want["gen"]["embedding"]).min()) > 0.99
    ours, theirs = voice.s3gen.tokens.reshape(-1), want["gen"]["prompt_token"].reshape(-1)
    assert ours.shape == theirs.shape and float((ours == theirs).float().mean()) > 0.95
    assert voice.prompt_tokens.shape == want["t3_prompt"].shape
    assert float((voice.prompt_tokens == want["t3_prompt"]).float().mean()) >= 0.5
