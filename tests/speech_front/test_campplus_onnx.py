"""``campplus.onnx`` (CosyVoice's CAM++ speaker encoder) read into ``CampPlus``.

The file is made here the way CosyVoice made its own: ``torch.onnx.export`` (TorchScript
exporter, opset 14, eval mode, constant folding, which folds each conv-then-BatchNorm pair)
of a tiny CAM++ with seeded weights. The module exported is ours, whose names and maths
``test_campplus.py`` pins to Chatterbox's copy of the reference; the embeddings of the model
read back from the graph are compared with the reference's recorded ones
(``fixtures/campplus.pt``, same seeded weights). The released file itself is unverified.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mstar.model.speech_front import CampPlus, CampPlusConfig
from mstar.model.speech_front.onnx_weights import campplus_onnx_state
from mstar.model.weights import load_weights
from tests.support.speech_front import FIXTURES, clips, max_rel_error, seeded_state

pytest.importorskip("onnx")
REF = torch.load(FIXTURES / "campplus.pt")
EMBED_TOL = 1e-5  # of the reference's peak


class _Graph(torch.nn.Module):
    """The network from mean-normalised fbank ``[B, T, 80]``, as CosyVoice exports it."""

    def __init__(self, model: CampPlus) -> None:
        super().__init__()
        self.head, self.xvector = model.head, model.xvector

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.xvector(self.head(feats.transpose(1, 2)))


def tiny_config() -> CampPlusConfig:
    t = REF["tiny"]
    return CampPlusConfig(embedding_size=t["embedding_size"], growth_rate=t["growth_rate"], bn_size=t["bn_size"],
                          init_channels=t["init_channels"])


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    model = CampPlus(tiny_config())
    load_weights(model, seeded_state(REF["keys"], seed=2).items())
    path = tmp_path_factory.mktemp("cv3") / "campplus.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Graph(model).eval(), torch.randn(1, 200, 80), str(path), input_names=["input"],
                          output_names=["output"], dynamic_axes={"input": {0: "batch", 1: "frames"}},
                          opset_version=14, dynamo=False, do_constant_folding=True)
    return path


def test_folded_graph_loads_and_matches_the_reference(onnx_file):
    weights = campplus_onnx_state(onnx_file)
    assert weights.unused == []  # every float initializer placed
    assert any(k.endswith("nonlinear2.batchnorm.running_mean") for k in weights.state)  # folded pairs seen
    model = CampPlus(tiny_config()).eval()
    load_weights(model, weights.state.items())  # strict: every parameter and buffer filled
    ours = model(clips())
    for row, ref in enumerate(REF["embeddings"]):
        err = max_rel_error(ours[row], ref.reshape(-1))
        assert err < EMBED_TOL, f"clip {row}: x-vector max error {err:.2e}"


def test_cosyvoice3_directory_loads_the_speaker_encoder(onnx_file):
    from mstar.model.cosyvoice3.checkpoint import load_speaker_encoder

    model = load_speaker_encoder(onnx_file.parent, tiny_config())
    assert max_rel_error(model(clips()[:1])[0], REF["embeddings"][0].reshape(-1)) < EMBED_TOL
