"""Record ``tests/model/fixtures/flow_cfm.pt``: CosyVoice2's own CFM mel decoder on tiny
random configs, for ``test_flow_cfm.py`` (a script, not collected by pytest).

The reference is ``cosyvoice-minicpmo==0.1.0`` (``cosyvoice.flow.decoder`` and
``.flow_matching``, with the ``matcha`` modules it bundles). Beside torch they need
``einops``, ``diffusers`` and ``conformer`` (``ConformerBlock`` is imported though the decoder
never uses it), which CI lacks; ``matcha.utils`` pulls hydra and lightning only for a logger,
so this script registers a stand-in for that logger module before importing. Run with::

    pip install --no-deps --target /tmp/fvenv conformer==0.3.2
    PYTHONPATH=/tmp/fvenv:. python tests/model/flow_cfm_fixtures.py

Each case stores the reference's state dict under the released ``decoder.estimator.``
prefix, its inputs, the estimator's output and the whole guided Euler solve from fixed noise.
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import torch

OUT = Path(__file__).parent / "fixtures" / "flow_cfm.pt"
MEL = 80  # the reference's solver hard-codes 80 mel channels
CASES = {
    # two U-Net levels (a stride-2 down/up pair), GroupNorm blocks
    "plain": dict(causal=False, channels=[8, 16], n_blocks=1, num_mid_blocks=2, num_heads=2,
                  attention_head_dim=8),
    # the released shape: one level, causal blocks, chunked attention when streaming
    "causal": dict(causal=True, channels=[8], n_blocks=2, num_mid_blocks=2, num_heads=2, attention_head_dim=8,
                   static_chunk_size=8, num_decoding_left_chunks=-1),
}
FRAMES = 24
STEPS = 4
CFG_RATE = 0.7


def reference_modules():
    pylogger = types.ModuleType("matcha.utils.pylogger")
    pylogger.get_pylogger = logging.getLogger
    utils = types.ModuleType("matcha.utils")
    utils.__path__ = []
    sys.modules.setdefault("matcha.utils", utils)
    sys.modules.setdefault("matcha.utils.pylogger", pylogger)
    from cosyvoice.flow import decoder, flow_matching
    return decoder, flow_matching


def record() -> dict:
    decoder, flow_matching = reference_modules()
    out = {}
    for name, case in CASES.items():
        torch.manual_seed(0)
        kwargs = {k: v for k, v in case.items() if k != "causal"}
        cls = decoder.CausalConditionalDecoder if case["causal"] else decoder.ConditionalDecoder
        est = cls(in_channels=4 * MEL, out_channels=MEL, dropout=0.0, act_fn="gelu", **kwargs).eval()
        with torch.no_grad():
            for p in est.parameters():
                p.add_(0.05 * torch.randn_like(p))
        lengths = torch.tensor([FRAMES, FRAMES - 5])
        mask = (torch.arange(FRAMES)[None] < lengths[:, None]).float()[:, None]
        x, mu, cond = (torch.randn(2, MEL, FRAMES) for _ in range(3))
        spks, t = torch.randn(2, MEL), torch.rand(2)
        with torch.no_grad():
            velocity = est(x, mask, mu, t, spks, cond)
            streamed = est(x, mask, mu, t, spks, cond, streaming=True) if case["causal"] else None
        params = types.SimpleNamespace(sigma_min=1e-6, solver="euler", t_scheduler="cosine",
                                       training_cfg_rate=0.2, inference_cfg_rate=CFG_RATE)
        cfm = flow_matching.ConditionalCFM(MEL, params, spk_emb_dim=MEL, estimator=est).eval()
        noise = torch.randn(1, MEL, FRAMES)
        t_span = 1 - torch.cos(torch.linspace(0, 1, STEPS + 1) * 0.5 * torch.pi)
        with torch.no_grad():
            mel = cfm.solve_euler(noise, t_span, mu[:1], mask[:1], spks[:1], cond[:1])
            mel_streamed = (cfm.solve_euler(noise, t_span, mu[:1], mask[:1], spks[:1], cond[:1], streaming=True)
                            if case["causal"] else None)
        out[name] = dict(
            config=case,
            state={f"decoder.estimator.{k}": v.clone() for k, v in est.state_dict().items()},
            inputs=dict(x=x, mask=mask, mu=mu, t=t, spks=spks, cond=cond, noise=noise),
            velocity=velocity, velocity_streamed=streamed, mel=mel, mel_streamed=mel_streamed,
            steps=STEPS, cfg_rate=CFG_RATE,
        )
    return out


if __name__ == "__main__":
    torch.save(record(), OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
