"""Live cross-check of CosyVoice3's DiT, flow module and LM against the official modules (a
script, not collected by pytest; the tests compare against what ``record_reference.py``
recorded, this one re-runs the reference at a second tiny geometry).

Run with the venv ``record_reference.py`` describes and a checkout of
github.com/FunAudioLLM/CosyVoice::

    PYTHONPATH=. /tmp/cvx/bin/python tests/cosyvoice3/dit_crosscheck.py --cosyvoice /path/to/CosyVoice

It builds the reference ``CausalMaskedDiffWithDiT`` (3 DiT blocks of width 64, 4 heads of 16,
chunks of 10 frames) and ``CosyVoice3LM`` (a 3-layer Qwen2) with perturbed random weights,
loads their state dicts into ours through the released-name maps (strict both ways) and prints
the max error (of the reference's peak) of the velocity on a padded batch (whole and chunked
attention), of the flow's mel (whole, chunked, and each call of the reference's chunk-by-chunk
``__main__`` check) and of the LM's speech logits over a greedy decode. Last run (2026-12-04,
CosyVoice ace7c47, torch 2.13.0+cpu, transformers 4.51.3, x-transformers 2.11.24): velocity
0.0 (bit-identical) whole and chunked; flow mel 1.4e-7 whole and chunked, at most 1.6e-7 per
streamed call; LM logits 8.9e-7 over 20 steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import record_reference as rec  # noqa: E402

from mstar.layers.paged_kv import allocate_kv_cache  # noqa: E402
from mstar.model.cosyvoice3 import (  # noqa: E402
    CosyVoice3Flow,
    DiTConfig,
    FlowConfig,
    SpeechLM,
    SpeechLMConfig,
    flow_name_map,
    llm_name_map,
    qwen2_config,
)
from mstar.model.flow import FlowEstimator  # noqa: E402
from mstar.model.weights import load_weights  # noqa: E402
from tests.support.pages import Pages  # noqa: E402

DIT = dict(dim=64, depth=3, heads=4, dim_head=16, ff_mult=2, mel_dim=80, mu_dim=80, spk_dim=80, out_channels=80,
           static_chunk_size=10, num_decoding_left_chunks=-1)
FLOW = dict(vocab_size=80, spk_embed_dim=24, lookahead_channels=40, token_mel_ratio=2, pre_lookahead_len=3)
QWEN2 = dict(rec.QWEN2, num_hidden_layers=3, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
             intermediate_size=96)


def err(ours: torch.Tensor, ref: torch.Tensor) -> str:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return f"{((ours - ref).abs().max() / ref.abs().max()).item():.2e}"


def check_flow() -> None:
    torch.manual_seed(10)  # the reference's initial weights
    ref = rec.build_flow(DIT, FLOW)
    rec.perturb(ref, 11, 0.1)
    ours = CosyVoice3Flow(FlowConfig(
        vocab_size=FLOW["vocab_size"], speaker_dim=FLOW["spk_embed_dim"], lookahead=FLOW["pre_lookahead_len"],
        lookahead_channels=FLOW["lookahead_channels"],
        dit=DiTConfig(dim=64, depth=3, heads=4, head_dim=16, ff_mult=2, static_chunk_size=10))).eval()
    load_weights(ours, ref.state_dict().items(), name_map=flow_name_map)
    g = torch.Generator().manual_seed(12)
    frames = 47
    mask = (torch.arange(frames)[None] < torch.tensor([[frames], [frames - 12]])).float()[:, None]
    x, mu, cond = (torch.randn(2, 80, frames, generator=g) for _ in range(3))
    spks, t = torch.randn(2, 80, generator=g), torch.rand(2, generator=g)
    with torch.no_grad():
        for streaming in (False, True):
            want = ref.decoder.estimator(x, mask, mu, t, spks, cond, streaming=streaming)
            got = ours.estimator(x, mask, FlowEstimator.conditioning(mu, spks, cond), t, streaming=streaming)
            print(f"DiT velocity, padded batch, {'chunked' if streaming else 'whole'}: {err(got, want)}")
    chunk = 5  # tokens per 10-frame attention chunk
    prompt = torch.randint(0, FLOW["vocab_size"], (1, chunk), generator=g)
    token = torch.randint(0, FLOW["vocab_size"], (1, 4 * chunk + 1), generator=g)
    prompt_feat, xvec = torch.randn(1, 2 * chunk, 80, generator=g), torch.randn(1, 24, generator=g)
    with torch.no_grad():
        for streaming in (False, True):
            want, _ = ref.inference(token, torch.tensor([token.shape[1]]), prompt, torch.tensor([chunk]), prompt_feat,
                                    torch.tensor([2 * chunk]), xvec, streaming=streaming, finalize=True)
            got = ours(token, prompt, prompt_feat, xvec, streaming=streaming)
            print(f"flow mel, {'chunked' if streaming else 'whole'}: {err(got, want)}")
        for i in range(0, token.shape[1], chunk):
            end = min(i + chunk + 3, token.shape[1])
            finalize = i + chunk + 3 >= token.shape[1]
            want, _ = ref.inference(token[:, :end], torch.tensor([end]), prompt, torch.tensor([chunk]), prompt_feat,
                                    torch.tensor([2 * chunk]), xvec, streaming=True, finalize=finalize)
            got = ours(token[:, :end], prompt, prompt_feat, xvec, streaming=True, finalize=finalize)
            print(f"flow mel, streamed call of {end} tokens (finalize={finalize}): {err(got, want)}")


def check_lm() -> None:
    from cosyvoice.llm.llm import CosyVoice3LM

    hidden, speech = QWEN2["hidden_size"], 30
    torch.manual_seed(14)
    ref = CosyVoice3LM(hidden, hidden, speech, rec.qwen2_encoder(QWEN2),
                       sampling=lambda scores, decoded, k: int(scores.argmax())).eval()
    rec.perturb(ref, 13)
    with torch.no_grad():
        ref.llm_decoder.weight[speech:] *= 0.05
    logits: list[torch.Tensor] = []
    ref.llm_decoder.register_forward_hook(lambda m, i, o: logits.append(o.detach()[0].clone()))
    prompt_text, text, prompt_speech = torch.tensor([[3, 151646]]), torch.tensor([[9, 8, 7, 6]]), torch.tensor([[1, 2]])
    with torch.no_grad():
        tokens = list(ref.inference(text, torch.tensor([4]), prompt_text, torch.tensor([2]), prompt_speech,
                                    torch.tensor([2]), torch.zeros(1, 0), max_token_text_ratio=5))
    ours = SpeechLM(SpeechLMConfig(backbone=qwen2_config(QWEN2), speech_token_size=speech)).eval()
    load_weights(ours, ref.state_dict().items(), name_map=llm_name_map)
    caches = allocate_kv_cache(*[ours.cache_shape()[0], 32, 4, *ours.cache_shape()[1:]], torch.float32,
                               torch.device("cpu"))
    pages = Pages(32, 4)
    got = []
    with torch.no_grad():
        ids = ours.prompt_ids(torch.cat([prompt_text[0], text[0]]), prompt_speech[0])
        for step in range(len(logits)):
            hidden_states = ours(ids, pages.step([("a", ids.shape[0])]), caches)
            got.append(ours.compute_logits(hidden_states[-1:])[0])
            if step < len(tokens):
                ids = torch.tensor([tokens[step]])
    print(f"CosyVoice3LM speech logits over {len(got)} greedy steps: {err(torch.stack(got), torch.stack(logits))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cosyvoice", required=True, type=Path, help="a FunAudioLLM/CosyVoice checkout")
    args = parser.parse_args()
    sys.path.insert(0, str(args.cosyvoice))
    rec.stand_ins()
    check_flow()
    check_lm()


if __name__ == "__main__":
    main()
