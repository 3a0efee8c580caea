"""Record ``tests/speech_front/fixtures/s3_v3_onnx.pt`` for ``test_onnx_front.py`` (a script,
not collected by pytest).

A tiny S3 tokenizer v3 (128 wide, two heads, two blocks) gets seeded weights; its state dict
is written as a released-layout ``speech_tokenizer_v3.onnx`` by
``tests/support/onnx_layouts.write_s3_v3_onnx`` and read back by the ``s3tokenizer`` package's
own converter (``onnx2torch_v3``, which the package uses on the released file). The script
checks that the converter returns exactly the seeded state, then records the converter's key
names and a fingerprint of each tensor (its dot product with a fixed random vector), and the
package model's tokens on the test clips with the converter's weights. Same venv as
``record_reference.py`` (s3tokenizer 0.3.0, onnx, torch 2.9.1)::

    /tmp/s3ref/bin/python tests/speech_front/record_onnx_reference.py
"""

from __future__ import annotations

import importlib.metadata
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.onnx_layouts import write_s3_v3_onnx  # noqa: E402
from tests.support.speech_front import FIXTURES, clips, seeded_state  # noqa: E402


def fingerprint(tensor: torch.Tensor) -> float:
    """A tensor's dot product with a fixed N(0, 1) vector: equal layouts give equal numbers,
    a transposed or swapped tensor does not."""
    flat = tensor.detach().double().flatten()
    probe = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return float(flat @ probe)


def main() -> None:
    import s3tokenizer
    from s3tokenizer.model_v3 import ModelConfigV3, S3TokenizerV3

    config = ModelConfigV3(n_mels=128, n_audio_state=128, n_audio_head=2, n_audio_layer=2)
    model = S3TokenizerV3("speech_tokenizer_v3_25hz", config).eval()
    keys = {k: list(v.shape) for k, v in model.state_dict().items()}
    state = seeded_state(keys, seed=3)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech_tokenizer_v3.onnx"
        write_s3_v3_onnx(state, path)
        converted = s3tokenizer.onnx2torch_v3(str(path), None, False)
    assert sorted(converted) == sorted(state), sorted(set(converted) ^ set(state))
    for key, value in state.items():
        assert torch.equal(converted[key], value), key
    model.load_state_dict(converted, strict=True)
    mels = [s3tokenizer.log_mel_spectrogram(w) for w in clips()]
    batch, lengths = s3tokenizer.padding(mels)
    tokens, token_len = model.quantize(batch, lengths)
    out = dict(
        versions={p: importlib.metadata.version(p) for p in ("s3tokenizer", "torch", "onnx")},
        keys=keys, fingerprints={k: fingerprint(v) for k, v in converted.items()},
        tokens=tokens.to(torch.int32), token_len=token_len)
    torch.save(out, FIXTURES / "s3_v3_onnx.pt")
    print(f"s3_v3_onnx.pt: {(FIXTURES / 's3_v3_onnx.pt').stat().st_size / 1e3:.0f} kB", out["versions"])


if __name__ == "__main__":
    main()
