"""Records ``fixtures/audioseal_tiny.safetensors``: a tiny AudioSeal generator and detector
(``TINY``) trained together for a few hundred steps on filtered noise, so that the detector
finds the generator's mark (not yet its bits), for the detection tests. The Hub's weights are
out of reach here; random weights detect nothing. Rerun (about five minutes on a CPU)::

    PYTHONPATH=$PWD python tests/model/record_audioseal_tiny.py

Tensors are our port's names under ``generator.`` and ``detector.``; the metadata holds the
config. Training uses the port's internals; the tests check the port against ``audioseal``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mstar.model import audio_watermark as aw

TINY = {"nbits": 16, "seanet": {"causal": True, "dimension": 16, "n_filters": 4, "ratios": [4, 2], "lstm": 1}}
ALPHA, STEPS, BATCH, SAMPLES = 0.3, 300, 16, 480
OUT = Path(__file__).resolve().parent / "fixtures" / "audioseal_tiny.safetensors"


def noise(batch: int, samples: int) -> torch.Tensor:
    """Low-passed noise at speech-like level."""
    return 0.3 * F.avg_pool1d(F.pad(torch.randn(batch, 1, samples), (2, 2)), 5, 1)


def main() -> None:
    torch.manual_seed(0)
    cfg = aw.SEANetConfig.from_dict(TINY)
    gen, det = aw.AudioSealGenerator(cfg), aw.AudioSealDetector(cfg)
    opt = torch.optim.Adam([*gen.parameters(), *det.parameters()], lr=3e-3)

    def logits(x: torch.Tensor) -> torch.Tensor:
        return det.head(det.upsample(aw._run(det.encoder, x))[..., : x.shape[-1]])

    ones = torch.ones(BATCH, SAMPLES, dtype=torch.long)
    for step in range(STEPS):
        x = noise(BATCH, SAMPLES)
        bits = torch.randint(0, 2, (BATCH, cfg.nbits))
        wm = ALPHA * gen._watermark(x, bits, None)
        marked, clean = logits(x + wm), logits(x)
        loss = (F.cross_entropy(marked[:, :2], ones) + F.cross_entropy(clean[:, :2], 0 * ones)
                + F.binary_cross_entropy_with_logits(marked[:, 2:].mean(-1), bits.float()) + 0.1 * wm.pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(step, float(loss), flush=True)
    tensors = {f"generator.{k}": v.contiguous() for k, v in gen.state_dict().items()}
    tensors |= {f"detector.{k}": v.contiguous() for k, v in det.state_dict().items()}
    save_file(tensors, OUT, metadata={"config": json.dumps(TINY), "alpha": str(ALPHA), "steps": str(STEPS)})


if __name__ == "__main__":
    main()
