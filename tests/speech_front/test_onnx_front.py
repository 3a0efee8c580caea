"""``speech_tokenizer_v3.onnx`` (the released CosyVoice3 tokenizer) read into ``S3Tokenizer``.

A tiny v3 (128 wide, two heads, two blocks; seeded weights) is written in the released ONNX
layout by ``tests/support/onnx_layouts.py``. ``fixtures/s3_v3_onnx.pt``, recorded by
``record_onnx_reference.py`` with ``s3tokenizer==0.3.0`` / ``onnx==1.23.2`` / ``torch==2.9.1``,
holds what the package's own converter (``onnx2torch_v3``) reads from that file (key names and
a fingerprint per tensor) and the package model's tokens with those weights. Needs ``onnx``
(the ``cosyvoice3`` extra; the dev install has it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.model.speech_front import S3Tokenizer, S3TokenizerConfig
from mstar.model.speech_front.onnx_weights import read_onnx, s3_tokenizer_v3_onnx_state
from mstar.model.weights import WeightLoadError, load_weights
from tests.support.onnx_layouts import write_s3_v3_onnx
from tests.support.speech_front import FIXTURES, clips, seeded_state

pytest.importorskip("onnx")
REF = torch.load(FIXTURES / "s3_v3_onnx.pt")


def fingerprint(tensor: torch.Tensor) -> float:
    """As ``record_onnx_reference.fingerprint``."""
    flat = tensor.detach().double().flatten()
    probe = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return float(flat @ probe)


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cv3") / "speech_tokenizer_v3.onnx"
    write_s3_v3_onnx(seeded_state(REF["keys"], seed=3), path)
    return path


def tokenizer() -> S3Tokenizer:
    return S3Tokenizer(S3TokenizerConfig(d_model=128, n_heads=2, n_layers=2)).eval()


def test_state_equals_the_package_converters(onnx_file):
    weights = s3_tokenizer_v3_onnx_state(onnx_file)
    assert sorted(weights.state) == sorted(REF["fingerprints"])
    for key, value in weights.state.items():
        assert list(value.shape) == REF["keys"][key], key
        ref = REF["fingerprints"][key]
        assert abs(fingerprint(value) - ref) <= 1e-9 * max(1.0, abs(ref)), key
    assert weights.unused == []  # every float initializer is a parameter
    assert weights.ignored and all("Reshape" in name for name in weights.ignored)


def test_loaded_tokenizer_gives_the_packages_tokens(onnx_file):
    model = tokenizer()
    load_weights(model, s3_tokenizer_v3_onnx_state(onnx_file).state.items())  # strict: every parameter filled
    tokens, counts = model(clips())
    assert counts.tolist() == REF["token_len"].tolist()
    for row, n in enumerate(counts.tolist()):
        assert torch.equal(tokens[row, :n], REF["tokens"][row, :n].long())


def test_unknown_and_missing_weights_are_reported(onnx_file):
    graph = read_onnx(onnx_file)
    graph.initializers["extra.weight"] = np.ones((4, 4), dtype=np.float32)
    graph.nodes = [n for n in graph.nodes if n[0] != "/blocks.1/mlp/mlp.2/MatMul"]
    weights = s3_tokenizer_v3_onnx_state(graph)
    assert "extra.weight" in weights.unused
    assert any(name.startswith("onnx::MatMul_") for name in weights.unused)  # the orphaned weight
    with pytest.raises(WeightLoadError, match=r"encoder\.blocks\.1\.mlp\.2\.weight"):
        load_weights(tokenizer(), weights.state.items())


def test_missing_onnx_package_names_the_install(monkeypatch, onnx_file):
    monkeypatch.setitem(__import__("sys").modules, "onnx", None)
    with pytest.raises(ImportError, match="onnx"):
        read_onnx(onnx_file)


def test_cosyvoice3_directory_loads_the_tokenizer_and_names_the_files(monkeypatch, onnx_file):
    """``onnx_file`` lies in a directory as a Fun-CosyVoice3 release names it."""
    from mstar.model.cosyvoice3.checkpoint import load_speaker_encoder, load_speech_tokenizer

    model_dir = onnx_file.parent
    model = load_speech_tokenizer(model_dir, S3TokenizerConfig(d_model=128, n_heads=2, n_layers=2))
    tokens, counts = model(clips())
    assert counts.tolist() == REF["token_len"].tolist()
    assert torch.equal(tokens[0, : counts[0]], REF["tokens"][0, : counts[0]].long())
    with pytest.raises(WeightLoadError, match="speech_tokenizer_v3.onnx"):  # a v3 of other shapes
        load_speech_tokenizer(model_dir, S3TokenizerConfig(d_model=128, n_heads=2, n_layers=1))
    with pytest.raises(FileNotFoundError, match="campplus.onnx"):
        load_speaker_encoder(model_dir)
    monkeypatch.setitem(__import__("sys").modules, "onnx", None)
    with pytest.raises(ImportError, match=r"speech_tokenizer_v3\.onnx: .*`onnx` package"):
        load_speech_tokenizer(model_dir)
