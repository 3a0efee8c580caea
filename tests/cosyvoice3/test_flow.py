"""CosyVoice3's flow module (``mstar.model.cosyvoice3.flow``) against the reference's
``CausalMaskedDiffWithDiT.inference``, recorded by ``record_reference.py`` (official code at
ace7c47): loaded from the ``flow.pt`` layout, it must give the reference's mel for a whole
decode (full and chunked attention) and for each call of the reference's own chunk-by-chunk
check (``finalize=False``, lookahead tokens as context); and the chunks our
``stream_schedule`` plans, joined, must equal the whole chunked decode."""

from __future__ import annotations

import pytest
import torch

from mstar.model.cosyvoice3 import CosyVoice3Flow, DiTConfig, FlowConfig, PreLookahead, flow_name_map, stream_schedule
from mstar.model.cosyvoice3.checkpoint import build_flow
from mstar.model.weights import load_weights

TOL = 1e-5  # of the reference's peak


def flow_config(case: dict) -> FlowConfig:
    """Our config of the recorded reference geometry."""
    d, f = case["dit"], case["flow"]
    dit = DiTConfig(dim=d["dim"], depth=d["depth"], heads=d["heads"], head_dim=d["dim_head"], ff_mult=d["ff_mult"],
                    static_chunk_size=d["static_chunk_size"])
    return FlowConfig(vocab_size=f["vocab_size"], speaker_dim=f["spk_embed_dim"], lookahead=f["pre_lookahead_len"],
                      lookahead_channels=f["lookahead_channels"], token_mel_ratio=f["token_mel_ratio"], dit=dit)


def build(case: dict) -> CosyVoice3Flow:
    model = CosyVoice3Flow(flow_config(case)).eval()
    load_weights(model, case["state"].items(), name_map=flow_name_map)  # strict both ways
    return model


def peak_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def flow(reference) -> tuple[CosyVoice3Flow, dict]:
    return build(reference["flow"]), reference["flow"]


def decode(model: CosyVoice3Flow, inputs: dict, tokens: torch.Tensor, streaming: bool, finalize: bool) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, inputs["prompt_token"], inputs["prompt_feat"], inputs["embedding"],
                     streaming=streaming, finalize=finalize)


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "chunked"])
def test_whole_decode_matches_reference(flow, streaming: bool) -> None:
    model, case = flow
    got = decode(model, case["inputs"], case["inputs"]["token"], streaming, True)
    err = peak_err(got, case["whole_streamed" if streaming else "whole"])
    print(f"[parity] flow mel ({'chunked' if streaming else 'whole'}): max err {err:.2e} of peak")
    assert err <= TOL


def test_each_streamed_call_matches_reference(flow) -> None:
    model, case = flow
    for call in case["chunks"]:
        got = decode(model, case["inputs"], case["inputs"]["token"][:, :call["tokens"]], True, call["finalize"])
        err = peak_err(got, call["mel"])
        print(f"[parity] flow call of {call['tokens']} tokens (finalize={call['finalize']}): max err {err:.2e}")
        assert err <= TOL


def test_scheduled_chunks_join_to_the_whole_decode(flow) -> None:
    model, case = flow
    inputs, tokens = case["inputs"], case["inputs"]["token"]
    ratio, hop = model.config.token_mel_ratio, model.config.dit.static_chunk_size // model.config.token_mel_ratio
    whole = decode(model, inputs, tokens, True, True)
    plan = list(stream_schedule(tokens.shape[1], inputs["prompt_token"].shape[1], hop=hop, max_hop=hop))
    assert len(plan) >= 3 and plan[-1].finalize
    pieces = [decode(model, inputs, tokens[:, :c.tokens], True, c.finalize)[..., c.offset * ratio:] for c in plan]
    joined = torch.cat(pieces, dim=-1)
    assert joined.shape == whole.shape
    assert peak_err(joined, whole) <= TOL


def test_schedule_pads_the_first_hop_to_a_chunk_boundary() -> None:
    plan = list(stream_schedule(total=300, prompt_tokens=30))
    assert [(c.tokens, c.offset, c.finalize) for c in plan] == [
        (48, 0, False),  # 25 + 20 padding: prompt + first hop = 75 tokens, three chunks
        (98, 45, False), (198, 95, False), (298, 195, False), (300, 295, True)]


def test_lookahead_context_equals_seeing_the_tokens() -> None:
    torch.manual_seed(0)
    layer = PreLookahead(6, 10, 3).eval()
    tokens = torch.randn(2, 12, 6)
    whole = layer(tokens)
    with_context = layer(tokens[:, :9], context=tokens[:, 9:])
    assert torch.allclose(with_context, whole[:, :9], atol=1e-6)
    assert not torch.allclose(layer(tokens[:, :9])[:, -1], whole[:, 8], atol=1e-3)


def test_a_bfloat16_dit_keeps_the_euler_state_float32(flow) -> None:
    model, case = flow
    inputs = case["inputs"]
    whole = decode(model, inputs, inputs["token"], True, True)
    half = build_flow(flow_config(case), estimator_dtype=torch.bfloat16).eval()  # the DiT made in bfloat16
    load_weights(half, case["state"].items(), name_map=flow_name_map)  # the float32 tensors cast as they load
    assert half.estimator.input_proj.weight.dtype == torch.bfloat16 and half.speaker_proj.weight.dtype == torch.float32
    assert half.estimator.rotary_inv_freq.dtype == torch.float32
    got = decode(half, inputs, inputs["token"], True, True)
    err = peak_err(got, whole)
    print(f"[bf16] flow mel with a bfloat16 DiT: {err:.2e} of peak")
    assert got.dtype == torch.float32 and 0 < err < 5e-2
