"""Record ``tests/speech_front/fixtures/*.pt``: the reference front ends' outputs for
``test_s3_tokenizer.py``, ``test_campplus.py`` and ``test_voice_encoder.py`` (a script, not
collected by pytest).

The references do not import beside our torch: ``s3tokenizer`` and Chatterbox's modules
import ``torchaudio`` (and ``onnx``, ``librosa``) at module level. Run in a separate venv::

    python3 -m venv /tmp/s3ref
    /tmp/s3ref/bin/pip install torch==2.9.1 'torchaudio==2.9.*' onnx einops tqdm numpy scipy \
        librosa==0.11.0 safetensors
    /tmp/s3ref/bin/pip install --no-deps s3tokenizer==0.3.0 chatterbox-tts==0.1.7
    /tmp/s3ref/bin/python tests/speech_front/record_reference.py

Chatterbox's ``__init__`` files import its whole TTS stack, so bare package objects stand in
for ``chatterbox`` and ``chatterbox.models.s3gen``, and only ``models.s3gen.xvector`` and
``models.voice_encoder`` are loaded.
Weights are drawn by ``tests/support/speech_front.seeded_state``; the fixtures keep the key
names and shapes (tiny and released geometry) and the outputs. ``clips.pt`` holds the test
clips as int16 PCM, made here from a fixed seed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.speech_front import FIXTURES, clips, long_clip, seeded_state  # noqa: E402


def chatterbox_modules() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """``xvector``, ``voice_encoder`` and its ``config`` without chatterbox's ``__init__``."""
    root = Path(importlib.util.find_spec("chatterbox").origin).parent
    for name, path in (("chatterbox", root), ("chatterbox.models.s3gen", root / "models" / "s3gen")):
        package = types.ModuleType(name)  # a bare package: its __init__ imports the whole TTS
        package.__path__ = [str(path)]
        sys.modules[name] = package
    leaves = ("models.s3gen.xvector", "models.voice_encoder.voice_encoder", "models.voice_encoder.config")
    return tuple(importlib.import_module(f"chatterbox.{leaf}") for leaf in leaves)


def versions() -> dict[str, str]:
    names = ["torch", "torchaudio", "numpy", "librosa", "s3tokenizer", "chatterbox-tts"]
    return {name: importlib.metadata.version(name) for name in names}


def shapes(module: torch.nn.Module, prefix: str = "") -> dict[str, list[int]]:
    return {prefix + k: list(v.shape) for k, v in module.state_dict().items()}


def make_clips() -> None:
    """Three speech-like clips: a gliding harmonic tone with syllable envelopes and noise;
    the first has 0.35 s and 0.3 s of near-silence around it (for silence trimming)."""
    rng = np.random.RandomState(20)
    sr = 16000

    def voiced(seconds: float, f0: tuple[float, float]) -> np.ndarray:
        t = np.arange(int(seconds * sr)) / sr
        freq = np.linspace(f0[0], f0[1], t.size)
        phase = 2 * np.pi * np.cumsum(freq) / sr
        wave = sum(np.sin(k * phase + rng.uniform(0, 6.28)) / k for k in range(1, 12))
        syllables = 0.55 + 0.45 * np.sin(2 * np.pi * 3.7 * t + rng.uniform(0, 6.28))
        return 0.25 * wave * syllables + 0.02 * rng.standard_normal(t.size)

    a = np.concatenate([1e-4 * rng.standard_normal(int(0.35 * sr)), voiced(2.4, (120, 210)),
                        1e-4 * rng.standard_normal(int(0.3 * sr))])
    b = voiced(1.37, (220, 160))
    c = voiced(0.613, (180, 190))
    pcm = [torch.from_numpy(np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)) for x in (a, b, c)]
    torch.save(pcm, FIXTURES / "clips.pt")


@torch.no_grad()
def record_s3(waves: list[torch.Tensor]) -> None:
    import s3tokenizer
    from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2
    from s3tokenizer.model_v3 import ModelConfigV3, S3TokenizerV3

    mels = [s3tokenizer.log_mel_spectrogram(w) for w in waves]
    out: dict = {"versions": versions(), "log_mel": mels}
    tiny = dict(n_mels=128, n_audio_state=128, n_audio_head=2)
    for name, cls, config, layers in (("v2", S3TokenizerV2, ModelConfig, 2), ("v3", S3TokenizerV3, ModelConfigV3, 1)):
        model = cls(f"speech_tokenizer_{name}_25hz", config(**tiny, n_audio_layer=layers)).eval()
        keys = shapes(model)
        model.load_state_dict(seeded_state(keys, seed=1), strict=True)
        batch, lengths = s3tokenizer.padding(mels)
        hidden, hidden_len = model.encoder(batch, lengths)
        tokens, token_len = model.quantize(batch, lengths)
        # Chatterbox's T3 prompt: the features cut to 4 * max_len frames before the encoder
        short, short_len = s3tokenizer.padding([m[:, : 4 * 10] for m in mels])
        prompt, prompt_len = model.quantize(short, short_len)
        out[name] = dict(
            layers=layers, keys=keys, hidden=hidden, hidden_len=hidden_len, tokens=tokens, token_len=token_len,
            prompt_tokens=prompt, prompt_len=prompt_len,
            released_keys=shapes(cls(f"speech_tokenizer_{name}_25hz", config())))
    # a clip over 30 s next to a short one: the package's windowed path (v2, tiny)
    model = S3TokenizerV2("speech_tokenizer_v2_25hz", ModelConfig(**tiny, n_audio_layer=2)).eval()
    model.load_state_dict(seeded_state(out["v2"]["keys"], seed=1))
    long_mel = s3tokenizer.log_mel_spectrogram(long_clip(waves[0], 57.0))
    batch, lengths = s3tokenizer.padding([long_mel, mels[1]])
    tokens, token_len = model.quantize(batch, lengths)
    out["long"] = dict(seconds=57.0, tokens=tokens, token_len=token_len)
    torch.save(out, FIXTURES / "s3_tokenizer.pt")
    # the released geometry (v2: 1280 wide, 20 heads, 6 blocks), random weights, one clip
    model = S3TokenizerV2("speech_tokenizer_v2_25hz", ModelConfig()).eval()
    model.load_state_dict(seeded_state(out["v2"]["released_keys"], seed=5))
    batch, lengths = s3tokenizer.padding(mels[1:2])
    hidden, _ = model.encoder(batch, lengths)
    tokens, _ = model.quantize(batch, lengths)
    torch.save(dict(versions=versions(), hidden=hidden, tokens=tokens), FIXTURES / "s3_tokenizer_full.pt")


@torch.no_grad()
def record_campplus(waves: list[torch.Tensor], xvector: types.ModuleType) -> None:
    import torchaudio.compliance.kaldi as kaldi

    fbanks = [kaldi.fbank(w[None], num_mel_bins=80) for w in waves]
    quiet = kaldi.fbank(waves[0][None] * 1e-3, num_mel_bins=80)  # low levels: the epsilon floor matters less
    tiny = dict(embedding_size=16, growth_rate=4, bn_size=2, init_channels=16)
    model = xvector.CAMPPlus(**tiny, memory_efficient=False).eval()
    keys = shapes(model)
    model.load_state_dict(seeded_state(keys, seed=2), strict=True)
    embeddings = [model.inference([w]) for w in waves]
    full = xvector.CAMPPlus(memory_efficient=False).eval()
    full.load_state_dict(seeded_state(shapes(full), seed=6))
    full_embeddings = [full.inference([w]) for w in waves]
    released = shapes(full, prefix="speaker_encoder.")
    torch.save(dict(versions=versions(), fbank=fbanks, fbank_quiet=quiet, tiny=tiny, keys=keys,
                    embeddings=embeddings, full_embeddings=full_embeddings, released_keys=released),
               FIXTURES / "campplus.pt")


@torch.no_grad()
def record_voice_encoder(waves: list[torch.Tensor], voice_encoder: types.ModuleType,
                         ve_config: types.ModuleType) -> None:
    import librosa
    from chatterbox.models.voice_encoder.melspec import melspectrogram

    class Tiny(ve_config.VoiceEncConfig):
        ve_hidden_size = 16
        speaker_embed_size = 8

    numpy_waves = [w.numpy() for w in waves]
    out: dict = {"versions": versions(), "tiny_config": dict(hidden_size=16, embed_size=8)}
    out["mel"] = [torch.from_numpy(melspectrogram(w, ve_config.VoiceEncConfig())) for w in numpy_waves]
    out["trim"] = [[int(i) for i in librosa.effects.trim(w, top_db=20)[1]] for w in numpy_waves]
    for name, hp, seed in (("tiny", Tiny(), 3), ("full", ve_config.VoiceEncConfig(), 4)):
        model = voice_encoder.VoiceEncoder(hp).eval()
        keys = shapes(model)
        model.load_state_dict(seeded_state(keys, seed=seed), strict=True)
        # Chatterbox's call: ChatterboxTTS.prepare_conditionals (trim at 20 dB, rate 1.3)
        embeds = model.embeds_from_wavs(numpy_waves, sample_rate=16000)
        out[name] = dict(keys=keys, embeddings=torch.from_numpy(embeds))
    torch.save(out, FIXTURES / "voice_encoder.pt")


def main() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    if not (FIXTURES / "clips.pt").exists():
        make_clips()
    waves = clips()
    xvector, voice_encoder, ve_config = chatterbox_modules()
    record_s3(waves)
    record_campplus(waves, xvector)
    record_voice_encoder(waves, voice_encoder, ve_config)
    for path in sorted(FIXTURES.glob("*.pt")):
        print(f"{path.name}: {path.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
