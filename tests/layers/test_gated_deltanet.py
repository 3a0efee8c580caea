"""Gated DeltaNet: the chunked and recurrent delta rules agree with each other and with
transformers' torch reference functions; the carried conv window equals one long causal
convolution; the layer on state slots matches transformers' Qwen3.5 layer (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from mstar.layers.gated_deltanet import (
    GatedDeltaNet,
    StateBatch,
    causal_conv,
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _inputs(batch: int, length: int, k_heads: int = 2, v_heads: int = 4, dim_k: int = 8, dim_v: int = 12,
            seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(batch, length, k_heads, dim_k, generator=gen))
    k = l2_normalize(torch.randn(batch, length, k_heads, dim_k, generator=gen))
    v = torch.randn(batch, length, v_heads, dim_v, generator=gen)
    g = -torch.rand(batch, length, v_heads, generator=gen) * 0.5  # log decay <= 0
    beta = torch.rand(batch, length, v_heads, generator=gen)
    state = torch.randn(batch, v_heads, dim_k, dim_v, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("length", "chunk_size"), [(1, 64), (37, 16), (150, 64)])
def test_chunked_equals_recurrent(length: int, chunk_size: int) -> None:
    q, k, v, g, beta, state = _inputs(2, length)
    out_r, state_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out_c, state_c = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert out_c.shape == v.shape and state_c.shape == state.shape
    assert rel_err(out_c, out_r) <= TOL
    assert rel_err(state_c, state_r) <= TOL


def test_split_sequence_continues_from_state() -> None:
    """A prefill in two pieces, the second from the first's final state, equals one pass."""
    q, k, v, g, beta, _ = _inputs(1, 90)
    whole, final = chunked_gated_delta_rule(q, k, v, g, beta)
    first, mid = chunked_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70])
    rest, end = recurrent_gated_delta_rule(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], mid)
    assert rel_err(torch.cat((first, rest), dim=1), whole) <= TOL
    assert rel_err(end, final) <= TOL


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.24"),
                    reason="older transformers lay out these functions' tensors differently")
@pytest.mark.parametrize("ours", [chunked_gated_delta_rule, recurrent_gated_delta_rule])
def test_rules_match_transformers(ours) -> None:
    q, k, v, g, beta, state = _inputs(2, 75, seed=3)
    raw_q, raw_k = q * 3.0, k * 0.5  # transformers normalises inside; we normalise outside
    mine, mine_state = ours(l2_normalize(raw_q), l2_normalize(raw_k), v, g, beta, state)
    for reference in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        ref, ref_state = reference(raw_q, raw_k, v, g, beta, initial_state=state.clone(),
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert rel_err(mine, ref) <= TOL
        assert rel_err(mine_state, ref_state) <= TOL


def test_causal_conv_window_carries() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 20, 6, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), weight).transpose(1, 2)
    window = torch.zeros(1, 3, 6)
    pieces = []
    for start, end in ((0, 9), (9, 10), (10, 11), (11, 20)):
        y, window = causal_conv(x[:, start:end], window, weight)
        pieces.append(y)
    assert rel_err(torch.cat(pieces, dim=1), ref) <= TOL
    assert torch.equal(window, x[:, -3:])


def test_causal_conv_shorter_than_window() -> None:
    x = torch.randn(1, 2, 3)
    weight = torch.randn(3, 4)
    y, window = causal_conv(x, torch.zeros(1, 3, 3), weight)
    assert y.shape == (1, 2, 3)
    assert torch.equal(window[:, 1:], x) and torch.equal(window[:, 0], torch.zeros(1, 3))


# ------------------------------------------------------------------- the layer
def _hf_layer() -> hf.Qwen3_5GatedDeltaNet:
    config = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                               num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    layer = hf.Qwen3_5GatedDeltaNet(config, 0).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.2 if param.ndim == 1 else 0.3))
        layer.norm.weight.add_(1.0)
    return layer


def _our_layer(reference: hf.Qwen3_5GatedDeltaNet) -> GatedDeltaNet:
    ours = GatedDeltaNet(32, 2, 4, 8, 8, 4).eval()
    missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=True)
    assert not missing and not unexpected
    return ours


@torch.no_grad()
def test_layer_on_slots_matches_transformers() -> None:
    """Two sequences share steps: A prefills 70 tokens then decodes; B prefills 5 in the
    second step, then both decode together. Each matches transformers on the whole sequence."""
    reference = _hf_layer()
    ours = _our_layer(reference)
    gen = torch.Generator().manual_seed(11)
    seq_a = torch.randn(1, 74, 32, generator=gen)
    seq_b = torch.randn(1, 8, 32, generator=gen)
    ref_a, ref_b = reference(seq_a), reference(seq_b)

    shapes = ours.state_shapes()
    conv_state = torch.zeros(3, *shapes["conv"])
    recurrent_state = torch.zeros(3, *shapes["recurrent"])
    slot_a, slot_b = 1, 0
    steps = [  # (rows of A, rows of B) per step
        ((0, 70), None),
        ((70, 71), (0, 5)),
        ((71, 72), (5, 6)),
        ((72, 73), (6, 7)),
        ((73, 74), (7, 8)),
    ]
    out_a, out_b = [], []
    for rows_a, rows_b in steps:
        parts, starts, slots = [seq_a[0, rows_a[0]:rows_a[1]]], [0, rows_a[1] - rows_a[0]], [slot_a]
        if rows_b is not None:
            parts.append(seq_b[0, rows_b[0]:rows_b[1]])
            starts.append(starts[-1] + rows_b[1] - rows_b[0])
            slots.append(slot_b)
        y = ours(torch.cat(parts), StateBatch.build(starts, slots, "cpu"), conv_state, recurrent_state)
        out_a.append(y[: starts[1]])
        if rows_b is not None:
            out_b.append(y[starts[1]:])
    assert rel_err(torch.cat(out_a), ref_a[0]) <= 1e-5
    assert rel_err(torch.cat(out_b), ref_b[0]) <= 1e-5
    assert torch.count_nonzero(conv_state[2]) == 0 and torch.count_nonzero(recurrent_state[2]) == 0  # sink untouched
