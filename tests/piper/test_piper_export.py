"""A tiny random multi-speaker VITS of Piper's own training code (``piper.train.vits``, from
piper-tts 1.8.0), exported to ONNX the way Piper's ``export_onnx.py`` does (decoder weight norm
removed, TorchScript exporter at opset 15, the ``scales``/``sid`` inputs), then read by us.

It covers what the released Joe voice does not: speakers (``emb_g`` and every ``cond``
layer), HiFi-GAN resblock type 1, and a plain export whose ``dp.flows.0`` keeps ``-logs``
unfolded. References: the torch module's own ``infer`` and onnxruntime on the exported file."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
models = pytest.importorskip("piper.train.vits.models")

from mstar.model.piper.modeling import PiperNoise, PiperVits  # noqa: E402
from mstar.model.piper.onnx_weights import read_piper_onnx  # noqa: E402
from mstar.model.weights import load_weights  # noqa: E402

TOLERANCE = 1e-5  # of peak (measured ~3e-7)
pytestmark = pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")  # the reference's own modules


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    ref = models.SynthesizerTrn(
        n_vocab=40, spec_channels=17, segment_size=8, inter_channels=16, hidden_channels=16, filter_channels=32,
        n_heads=2, n_layers=2, kernel_size=3, p_dropout=0.0, resblock="1", resblock_kernel_sizes=(3, 5),
        resblock_dilation_sizes=((1, 3, 5), (1, 2, 4)), upsample_rates=(4, 2), upsample_initial_channel=32,
        upsample_kernel_sizes=(8, 4), n_speakers=3, gin_channels=8).eval()
    with torch.no_grad():
        for p in ref.parameters():  # the init leaves biases at zero: make every weight count
            p.normal_(0, 0.2)
        ref.dec.remove_weight_norm()

    def infer(text, lengths, scales, sid):
        return ref.infer(text, lengths, noise_scale=scales[0], length_scale=scales[1], noise_scale_w=scales[2],
                         sid=sid)[0].unsqueeze(1)

    ref.forward = infer
    path = tmp_path_factory.mktemp("piper") / "tiny.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(ref, (torch.randint(0, 40, (1, 50)), torch.LongTensor([50]),
                                torch.FloatTensor([0.667, 1.0, 0.8]), torch.LongTensor([0])),
                          str(path), opset_version=15, input_names=["input", "input_lengths", "scales", "sid"],
                          output_names=["output"], dynamo=False,
                          dynamic_axes={"input": {0: "batch_size", 1: "phonemes"}, "input_lengths": {0: "batch_size"},
                                        "output": {0: "batch_size", 2: "time"}})
    weights = read_piper_onnx(path)
    ours = PiperVits(weights.arch).eval()
    load_weights(ours, weights.tensors.items())  # strict: coverage both ways
    return ref, path, ours


def _ours(model: PiperVits, ids: torch.Tensor, speaker: int) -> np.ndarray:
    one = torch.ones(1)
    out = model(ids, torch.tensor([ids.shape[1]]), noise_scale=one * 0, length_scale=one * 1.1, noise_w=one * 0,
                noise=PiperNoise(), speakers=torch.tensor([speaker]))
    return out.audio[0].numpy()


def test_architecture_is_read_from_the_graph(exported) -> None:
    _, _, ours = exported
    arch = ours.arch
    assert (arch.n_speakers, arch.gin_channels, arch.resblock) == (3, 8, "1")
    assert arch.resblock_dilation_sizes == ((1, 3, 5), (1, 2, 4)) and arch.upsample_rates == (4, 2)


def test_each_speaker_matches_the_torch_reference_and_onnxruntime(exported) -> None:
    ref, path, ours = exported
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = torch.randint(1, 40, (1, 23), generator=torch.Generator().manual_seed(1))
    audios = []
    for speaker in range(3):
        got = _ours(ours, ids, speaker)
        with torch.no_grad():
            want = ref.infer(ids, torch.tensor([23]), sid=torch.tensor([speaker]), noise_scale=0.0,
                             length_scale=1.1, noise_scale_w=0.0)[0].reshape(-1).numpy()
        runtime = session.run(None, {"input": ids.numpy(), "input_lengths": np.array([23]),
                                     "scales": np.array([0, 1.1, 0], np.float32),
                                     "sid": np.array([speaker])})[0].reshape(-1)
        assert got.shape == want.shape == runtime.shape
        assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()
        assert np.abs(got - runtime).max() <= TOLERANCE * np.abs(runtime).max()
        audios.append(got)
    assert not np.allclose(audios[0], audios[1])  # the speaker matters


def test_a_served_multi_speaker_voice_picks_the_speaker_by_name(exported) -> None:
    import asyncio
    import json

    from mstar.config import parse_config
    from mstar.contract import RequestError, SpeechSpec
    from mstar.model.speech_output import pcm_to_array
    from mstar.runtime.launch import start

    _, path, ours = exported
    id_map = {"_": [0], "^": [1], "$": [2], " ": [3]} | {c: [4 + i] for i, c in enumerate("abcdefghij")}
    path.with_name(path.name + ".json").write_text(json.dumps({
        "audio": {"sample_rate": 16000}, "espeak": {"voice": "en-us"}, "phoneme_type": "espeak",
        "phoneme_id_map": id_map, "num_symbols": 40, "num_speakers": 3, "dataset": "tiny",
        "speaker_id_map": {"ann": 0, "bob": 1, "cy": 2},
        "inference": {"noise_scale": 0.5, "length_scale": 1.0, "noise_w": 0.6}}))
    config = parse_config({"model": "piper", "model_path": str(path), "device": "cpu",
                           "node_groups": [{"node_names": ["piper"], "ranks": [0]}]})
    deployment = start(config, in_process=True)
    try:
        async def run(spec: SpeechSpec) -> list:
            return [e async for e in deployment.backend.speech(spec)]

        assert deployment.backend.voices() == ["ann", "bob", "cy"]
        assert deployment.backend.sample_rate == 16000
        got = pcm_to_array(asyncio.run(run(SpeechSpec("s", "-", "bob", 1.0, {"phonemes": "abc ja", "seed": 4}))))
        ids = [1, 0, 4, 0, 5, 0, 6, 0, 3, 0, 13, 0, 4, 0, 2]
        gen = torch.Generator().manual_seed(4 * 1_000_003)
        one = torch.ones(1)
        want = ours(torch.tensor([ids]), torch.tensor([len(ids)]), noise_scale=one * 0.5, length_scale=one,
                    noise_w=one * 0.6, noise=PiperNoise(generators=[gen]), speakers=torch.tensor([1])).audio[0]
        assert got.shape == tuple(want.shape)
        assert np.abs(got - want.numpy()).max() <= 1e-6 * float(want.abs().max())
        with pytest.raises(RequestError, match="voice"):
            asyncio.run(run(SpeechSpec("s2", "-", "nobody", 1.0, {"phonemes": "abc"})))
    finally:
        deployment.close()
