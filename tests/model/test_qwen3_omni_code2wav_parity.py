"""Qwen3-Omni's codec decoder against transformers' ``Qwen3OmniMoeCode2Wav`` (fp32, CPU, tiny
random config): the whole clip, batched and alone; the chunked decode against the reference's
``chunked_decode``; and the loader of the released ``code2wav.`` keys, coverage both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers.models.qwen3_omni_moe")

from mstar.model.qwen3_omni.checkpoint import load_code2wav, load_code2wav_dir  # noqa: E402
from mstar.model.qwen3_omni.code2wav import Qwen3OmniCode2Wav, Qwen3OmniCode2WavConfig  # noqa: E402
from mstar.model.weights import WeightLoadError  # noqa: E402
from tests.support.qwen3_omni import CODE2WAV, reference_code2wav, released_code2wav_keys  # noqa: E402

TOL = 1e-5  # of the waveform's largest sample


@pytest.fixture(scope="module")
def reference():
    return reference_code2wav(seed=3)


@pytest.fixture(scope="module")
def ours(reference):
    decoder = Qwen3OmniCode2Wav(Qwen3OmniCode2WavConfig.from_hf_dict({"code2wav_config": reference.config.to_dict()}))
    load_code2wav(decoder, released_code2wav_keys(reference))
    return decoder.eval()


def codes(batch: int, frames: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CODE2WAV["codebook_size"], (batch, CODE2WAV["num_quantizers"], frames), generator=gen)


def assert_wave_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    scale = theirs.abs().max()
    assert 0.05 < scale < 1.0  # a real signal, not clamped flat
    assert (ours - theirs).abs().max() <= TOL * scale


def test_whole_clip(reference, ours) -> None:
    clip = codes(2, 40, seed=0)  # 40 frames: the 6-frame attention window slides
    with torch.no_grad():
        theirs = reference(clip)[:, 0]
        batched, alone = ours(clip), ours(clip[1])
    assert ours.config.samples_per_frame == 24
    assert theirs.shape[-1] == 40 * 24 - (4 * 3 + 3)  # each decoder block trims r samples, later blocks scale them
    assert_wave_close(batched, theirs)
    assert_wave_close(alone, theirs[1])


@pytest.mark.parametrize(("chunk", "context"), [(12, 4), (300, 25)])
def test_chunked_decode(reference, ours, chunk: int, context: int) -> None:
    frames = 2 * chunk + chunk // 2 + 1  # two whole chunks and a short third
    clip = codes(1, frames, seed=1)
    with torch.no_grad():
        theirs = reference.chunked_decode(clip, chunk_size=chunk, left_context_size=context)[:, 0]
        pieces = list(ours.decode_chunks(clip, chunk, context))
        whole = ours(clip)
    assert len(pieces) == 3
    assert_wave_close(torch.cat(pieces, dim=-1), theirs)
    assert_wave_close(ours.chunked_decode(clip, chunk, context), theirs)
    assert whole.shape[-1] > theirs.shape[-1]  # each chunk's trims: chunked is not the whole clip


def test_loader_coverage(reference, tmp_path: Path) -> None:
    keys = released_code2wav_keys(reference)
    others = [("thinker.model.norm.weight", torch.ones(4)), ("talker.model.norm.weight", torch.ones(4))]
    config = Qwen3OmniCode2WavConfig(**CODE2WAV)
    missing = "code2wav.pre_transformer.layers.1.mlp_layer_scale.scale"
    with pytest.raises(WeightLoadError, match=missing[len("code2wav."):].replace(".", r"\.")):
        load_code2wav(Qwen3OmniCode2Wav(config), [(n, t) for n, t in keys if n != missing] + others)
    with pytest.raises(WeightLoadError, match=r"decoder\.9\.conv\.weight"):
        load_code2wav(Qwen3OmniCode2Wav(config), keys + [("code2wav.decoder.9.conv.weight", torch.ones(1))])

    save_file({n: t.contiguous() for n, t in keys + others}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe",
                                                      "code2wav_config": reference.config.to_dict()}))
    decoder = load_code2wav_dir(tmp_path)
    theirs = reference.state_dict()
    assert sorted(decoder.state_dict()) == sorted(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(decoder.state_dict()[name], tensor, rtol=0, atol=0)
