"""Record ``tests/model/fixtures/flow_cfm.pt``: CosyVoice2's own CFM mel decoder on tiny
random configs, for ``test_flow_cfm.py`` (a script, not collected by pytest).

The reference is ``cosyvoice-minicpmo==0.1.0`` (``cosyvoice.flow.decoder`` and
``.flow_matching``, with the ``matcha`` modules it bundles). Beside torch they need
``einops``, ``diffusers`` and ``conformer`` (``ConformerBlock`` is imported though the decoder
never uses it), which CI lacks; ``matcha.utils`` pulls hydra and lightning only for a logger
and ``cosyvoice.flow.flow`` imports omegaconf only for a default argument, so this script
registers stand-ins for those two before importing. Run with::

    pip install --no-deps --target /tmp/fvenv conformer==0.3.2
    PYTHONPATH=/tmp/fvenv:. python tests/model/flow_cfm_fixtures.py

Each case stores the reference's state dict under the released ``decoder.estimator.``
prefix, its inputs, the estimator's output and the whole guided Euler solve from fixed noise.
``flow`` runs the flow module's inference (``CausalMaskedDiffWithXvec``) around the causal
estimator, with a stand-in for its conformer encoder (a linear map, each token repeated for
two frames) whose weights are stored too; ``noise_head`` is the start of the causal sampler's
fixed noise table. ``flow_cfm_keys.json`` lists the names and shapes of the estimator's
parameters at CosyVoice2-0.5B's released geometry (``cosyvoice2.yaml``), as ``flow.pt``
stores them.
"""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import torch

OUT = Path(__file__).parent / "fixtures" / "flow_cfm.pt"
KEYS = Path(__file__).parent / "fixtures" / "flow_cfm_keys.json"
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
    omegaconf = types.ModuleType("omegaconf")
    omegaconf.DictConfig = lambda d: types.SimpleNamespace(**d)
    sys.modules.setdefault("omegaconf", omegaconf)
    from cosyvoice.flow import decoder, flow, flow_matching
    return decoder, flow, flow_matching


class StandInEncoder(torch.nn.Module):
    """In place of the upsampling conformer: a linear map of each token, repeated for two frames."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.proj = torch.nn.Linear(width_in, width_out)
        self.width_out = width_out

    def output_size(self) -> int:
        return self.width_out

    def forward(self, tokens, lengths, context=None, streaming=False):
        return self.proj(tokens).repeat_interleave(2, dim=1), 2 * lengths


def record_flow(flow, flow_matching, estimator) -> dict:
    torch.manual_seed(1)
    params = types.SimpleNamespace(sigma_min=1e-6, solver="euler", t_scheduler="cosine",
                                   training_cfg_rate=0.2, inference_cfg_rate=CFG_RATE)
    cfm = flow_matching.CausalConditionalCFM(MEL, params, spk_emb_dim=MEL, estimator=estimator).eval()
    module = flow.CausalMaskedDiffWithXvec(input_size=16, output_size=MEL, spk_embed_dim=12, vocab_size=50,
                                           encoder=StandInEncoder(16, 20), decoder=cfm).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt_token, token = torch.randint(0, 50, (1, 5)), torch.randint(0, 50, (1, 7))
    prompt_feat, embedding = torch.randn(1, 10, MEL), torch.randn(1, 12)
    args = (token, torch.tensor([7]), prompt_token, torch.tensor([5]), prompt_feat, torch.tensor([10]), embedding)
    with torch.no_grad():
        mel, _ = module.inference(*args, streaming=False, finalize=True)
        mel_streamed, _ = module.inference(*args, streaming=True, finalize=True)
    return dict(state={k: v.clone() for k, v in module.state_dict().items()},
                inputs=dict(prompt_token=prompt_token, token=token, prompt_feat=prompt_feat, embedding=embedding),
                mel=mel, mel_streamed=mel_streamed, noise_head=cfm.rand_noise[:, :, :32].clone())


def record() -> dict:
    decoder, flow, flow_matching = reference_modules()
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
    out["flow"] = record_flow(flow, flow_matching, est)  # the causal estimator
    return out


def released_keys() -> dict:
    decoder, _, _ = reference_modules()
    with torch.device("meta"):
        est = decoder.CausalConditionalDecoder(in_channels=320, out_channels=80, channels=[256], dropout=0.0,
                                               attention_head_dim=64, n_blocks=4, num_mid_blocks=12, num_heads=8,
                                               act_fn="gelu", static_chunk_size=50, num_decoding_left_chunks=-1)
    return {f"decoder.estimator.{k}": list(v.shape) for k, v in est.state_dict().items()}


if __name__ == "__main__":
    torch.save(record(), OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    KEYS.write_text(json.dumps(released_keys(), indent=0) + "\n")
    print(f"wrote {KEYS} ({KEYS.stat().st_size} bytes)")
