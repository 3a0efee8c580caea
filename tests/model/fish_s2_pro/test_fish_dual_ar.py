"""Fish S2-Pro's dual AR against fish-speech's ``DualARTransformer`` (the fixtures
``record_reference.py`` wrote: fish-speech 0.1.0 in the S1 form, and the GitHub source with
S2's config, names and normed fast-AR input): slow logits and fast logits at every step
within 1e-5 on a tiny random config, fp32, on the CPU, the slow AR on a paged KV cache of
4-slot pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.fish_s2_pro.config import DualARConfig
from mstar.model.fish_s2_pro.dual_ar import DualAR
from mstar.model.fish_s2_pro.paging import step_metadata
from mstar.model.fish_s2_pro.weights import dual_ar_tensors, interleaved_to_half

FIXTURES = {name: torch.load(Path(__file__).parent / "fixtures" / f"{name}.pt") for name in ("dual_ar", "dual_ar_s2")}
FIXTURE = FIXTURES["dual_ar"]
PAGE = 4


def reference_model(fixture: dict = FIXTURE) -> DualAR:
    config = DualARConfig.from_dict({"semantic_begin_id": fixture["semantic_begin_id"], **fixture["config"],
                                     "eos_token_id": 2})
    model = DualAR(config).eval()
    model.load_state_dict(dual_ar_tensors(config, fixture["state_dict"]), strict=True)
    return model


def run_steps(model: DualAR, pages: list[int], teacher: bool = True, fixture: dict = FIXTURE):
    """Prefill then decode on ``pages``; each step's slow logits, fast logits and frame."""
    layers, heads, head_dim = model.cache_shape()
    caches = allocate_kv_cache(layers, 16, PAGE, heads, head_dim, torch.float32, "cpu")
    tokens, codes = fixture["prompt_tokens"], fixture["prompt_codes"]
    start, slow, fast, frames = 0, [], [], []
    with torch.no_grad():
        for step in range(len(fixture["codes"])):
            meta = step_metadata([pages], [start], [len(tokens)], PAGE)
            normed, hidden = model.slow(tokens, codes, meta, caches)
            logits = model.slow.logits(normed[-1:])[0]
            slow.append(logits)
            begin = model.config.semantic_begin_id
            token = begin + int(logits[begin:begin + model.config.codebook_size].argmax())
            books = []
            frame = model.fast(hidden[-1:], model.code0(torch.tensor([token])),
                               on_logits=lambda book, lg, books=books: books.append(lg[0]))
            fast.append(torch.stack(books))
            frames.append(frame.codes[0])
            start += len(tokens)
            next_codes = fixture["codes"][step] if teacher else frame.codes[0]
            tokens, codes = torch.tensor([token]), next_codes[None]
    return torch.stack(slow), torch.stack(fast), torch.stack(frames)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_slow_and_fast_logits_match_fish_speech(name):
    fixture = FIXTURES[name]
    slow, fast, frames = run_steps(reference_model(fixture), pages=[3, 0, 7, 1], fixture=fixture)
    torch.testing.assert_close(slow, fixture["slow_logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(fast, fixture["fast_logits"], rtol=0, atol=1e-5)
    assert torch.equal(frames, fixture["codes"])


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_free_running_greedy_codes_match(name):
    fixture = FIXTURES[name]
    _, _, frames = run_steps(reference_model(fixture), pages=[5, 2, 9, 4], teacher=False, fixture=fixture)
    assert torch.equal(frames, fixture["codes"])


def test_s2_config_reads_as_fish_speech_reads_it():
    config = reference_model(FIXTURES["dual_ar_s2"]).config
    assert config.norm_fastlayer_input and config.scale_codebook_embeddings
    assert (config.semantic_begin_id, config.num_codebooks, config.n_fast_layer, config.fast_dim) == (70, 4, 2, 24)


def test_interleaved_to_half_keeps_pairs_together():
    rows = torch.arange(8.0)[:, None].repeat(2, 3)  # two heads of 8 channels
    out = interleaved_to_half(rows, 8)[:, 0]
    assert out.tolist() == [0, 2, 4, 6, 1, 3, 5, 7] * 2


def test_unknown_released_tensor_is_named():
    config = reference_model().config
    with pytest.raises(KeyError, match="extra.weight"):
        dual_ar_tensors(config, {**FIXTURE["state_dict"], "extra.weight": torch.zeros(1)})


def test_batched_frames_equal_solo():
    """Two requests in one fast-AR call give each its solo frame."""
    model = reference_model()
    torch.manual_seed(1)
    hidden = torch.randn(2, model.config.dim)
    code0 = torch.tensor([3, 12])
    with torch.no_grad():
        both = model.fast(hidden, code0).codes
        solo = torch.cat([model.fast(hidden[i:i + 1], code0[i:i + 1]).codes for i in range(2)])
    assert torch.equal(both, solo)
