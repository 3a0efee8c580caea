"""Tests for the batched sampler: HF parity, batch independence, seeding, validation."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mstar.contract import SamplingParams
from mstar.engine.sampler import Sampler, SeenTokens, seen_mask, validate_sampling

VOCAB = 1000
SP = SamplingParams


def hf_processed(logits: torch.Tensor, p: SamplingParams, seen: list[int]) -> torch.Tensor:
    """One row's scores processed as transformers' ``generate`` would (same order)."""
    scores = logits.float()[None].clone()
    input_ids = torch.tensor([seen], dtype=torch.long).reshape(1, len(seen))
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty))(input_ids, scores)
    if p.greedy:
        return scores[0]
    warpers = []
    if p.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(p.temperature)))
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for warp in warpers:
        scores = warp(input_ids, scores)
    return scores[0]


def assert_same_distribution(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isneginf(ours), torch.isneginf(ref)), "different tokens filtered"
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.log_softmax(-1), ref.log_softmax(-1), atol=1e-5, rtol=1e-5)


PARITY_CASES = [
    SP(),
    SP(temperature=0.7),
    SP(temperature=1.8),
    SP(top_k=20),
    SP(top_k=1),
    SP(top_k=VOCAB + 5),
    SP(top_k=-1),
    SP(top_p=0.8),
    SP(top_p=0.05),
    SP(min_p=0.1),
    SP(min_p=1.0),
    SP(repetition_penalty=1.3),
    SP(repetition_penalty=0.7),
    SP(temperature=0.6, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    SP(temperature=1.5, top_p=0.5, min_p=0.02, repetition_penalty=2.0),
    SP(temperature=0.0, repetition_penalty=1.5),
    SP(temperature=0.0, top_k=3, top_p=0.5),
]


def random_batch(seed: int, rows: int) -> tuple[torch.Tensor, list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen) * 3.0
    seen = [
        torch.randint(0, VOCAB, (int(n),), generator=gen).tolist()
        for n in torch.randint(0, 60, (rows,), generator=gen)
    ]
    return logits, seen


# ----------------------------------------------------------------- parity
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processed_logits_match_transformers(seed: int) -> None:
    logits, seen = random_batch(seed, len(PARITY_CASES))
    sampler = Sampler()
    batched = sampler.processed_logits(logits, PARITY_CASES, seen_mask(seen, VOCAB))
    assert batched.dtype == torch.float32 and batched.shape == logits.shape
    for i, p in enumerate(PARITY_CASES):
        ref = hf_processed(logits[i], p, seen[i])
        alone = sampler.processed_logits(logits[i : i + 1], [p], seen_mask([seen[i]], VOCAB))[0]
        assert_same_distribution(alone, ref)
        assert_same_distribution(batched[i], ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_are_processed_in_float32(dtype: torch.dtype) -> None:
    logits, seen = random_batch(3, len(PARITY_CASES))
    logits = logits.to(dtype)
    ours = Sampler().processed_logits(logits, PARITY_CASES, seen_mask(seen, VOCAB))
    assert ours.dtype == torch.float32
    for i, p in enumerate(PARITY_CASES):
        assert_same_distribution(ours[i], hf_processed(logits[i].float(), p, seen[i]))


def test_inputs_are_not_modified() -> None:
    logits, seen = random_batch(4, len(PARITY_CASES))
    before = logits.clone()
    mask = seen_mask(seen, VOCAB)
    Sampler()(logits, PARITY_CASES, [None] * len(PARITY_CASES), mask)
    assert torch.equal(logits, before) and torch.equal(mask, seen_mask(seen, VOCAB))


# ----------------------------------------------------------------- greedy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(5)).to(dtype)
    params = [SP(temperature=0.0, top_k=5, top_p=0.3, seed=i) for i in range(6)]
    tokens = Sampler()(logits, params, [None] * 6)
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    # also with (ignored) seen tokens and the penalty disabled
    assert torch.equal(Sampler()(logits, params, [None] * 6, seen_mask([[1, 2]] * 6, VOCAB)), tokens)


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(6))
    params = [SP(temperature=0.0), SP(temperature=1.0), SP(temperature=0.0), SP(top_p=0.5)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    tokens = Sampler()(logits, params, gens)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_top_k_one_sampling_is_argmax() -> None:
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(7))
    tokens = Sampler()(logits, [SP(top_k=1, temperature=1.3)] * 8, [None] * 8)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_repetition_penalty_changes_greedy_choice() -> None:
    sampler = Sampler()
    logits = torch.tensor(
        [
            [2.0, 1.9, 0.0, -3.0],  # positive: 2.0 / 1.2 < 1.9
            [-0.5, -0.8, -3.0, -4.0],  # negative: -0.5 * 2 < -0.8
            [2.0, 1.9, 0.0, -3.0],  # same logits, no penalty
            [1.0, 1.2, 0.0, -3.0],  # penalty < 1 boosts: 1.0 / 0.5 > 1.2
        ]
    )
    params = [
        SP(temperature=0.0, repetition_penalty=1.2),
        SP(temperature=0.0, repetition_penalty=2.0),
        SP(temperature=0.0),
        SP(temperature=0.0, repetition_penalty=0.5),
    ]
    seen = [[0, 0, 99, -1], [0], [0], [0]]  # duplicates and out-of-vocab ids are harmless
    assert sampler(logits, params, [None] * 4).tolist() == [0, 0, 0, 1]
    assert sampler(logits, params, [None] * 4, seen_mask(seen, 4)).tolist() == [1, 1, 0, 0]
    assert sampler(logits, params, [None] * 4, seen_mask([[]] * 4, 4)).tolist() == [0, 0, 0, 1]


# ---------------------------------------------------------------- seeding
def _seeded_run(
    step_logits: list[torch.Tensor], p: SamplingParams, position: int, batch: int
) -> list[int]:
    """Sample the target row ``p`` at ``position`` of a noisy mixed batch, step by step."""
    assert p.seed is not None
    sampler = Sampler()
    target_gen = torch.Generator().manual_seed(p.seed)
    other = torch.Generator().manual_seed(1000 + batch)
    others = [SP(), SP(temperature=0.0), SP(top_k=3, seed=7), SP(min_p=0.2, repetition_penalty=1.1)]
    other_gens = [None, None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    out = []
    for logits in step_logits:
        rows = torch.randn(batch, VOCAB, generator=other)
        rows[position] = logits
        params = [others[i % len(others)] for i in range(batch)]
        gens: list[torch.Generator | None] = [other_gens[i % len(others)] for i in range(batch)]
        params[position], gens[position] = p, target_gen
        seen = [[1, 2, 3]] * batch
        out.append(int(sampler(rows, params, gens, seen_mask(seen, VOCAB))[position]))
    return out


def test_seeded_row_is_reproducible_alone_and_in_mixed_batches() -> None:
    step_gen = torch.Generator().manual_seed(11)
    steps = [torch.randn(VOCAB, generator=step_gen) for _ in range(25)]
    p = SP(temperature=1.2, top_p=0.95, repetition_penalty=1.1, seed=1234)
    alone = _seeded_run(steps, p, position=0, batch=1)
    assert _seeded_run(steps, p, position=0, batch=1) == alone
    for position, batch in [(0, 5), (3, 4), (6, 7)]:
        assert _seeded_run(steps, p, position, batch) == alone
    other_seed = _seeded_run(steps, SP(temperature=1.2, top_p=0.95, seed=4321), 0, 1)
    assert other_seed != alone


def test_global_rng_rows_do_not_disturb_seeded_rows() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(12))
    params = [SP(), SP(seed=5), SP()]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        a = Sampler()(logits, params, [None, torch.Generator().manual_seed(5), None])
        torch.manual_seed(1)
        b = Sampler()(logits, params, [None, torch.Generator().manual_seed(5), None])
    assert a[1] == b[1]


# ------------------------------------------------------- empirical check
FREQ_LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0])
FREQ_PARAMS = SP(temperature=0.8, top_k=7, top_p=0.95, min_p=0.05)


def _check_frequencies(tokens: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    freq = torch.bincount(tokens, minlength=expected.numel()).double() / tokens.numel()
    assert torch.all(freq[expected == 0] == 0), "sampled a filtered token"
    assert (freq - expected.double()).abs().max() < tol


def test_sampling_frequencies_follow_filtered_distribution() -> None:
    n = 20000
    sampler = Sampler()
    expected = sampler.processed_logits(FREQ_LOGITS[None], [FREQ_PARAMS])[0].softmax(-1)
    assert (expected == 0).sum() >= 3  # the filters actually removed something
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = sampler(FREQ_LOGITS.expand(n, -1), [FREQ_PARAMS] * n, [None] * n)
    _check_frequencies(tokens, expected, tol=0.015)


def test_sampling_frequencies_with_a_generator() -> None:
    n = 4000
    sampler = Sampler()
    expected = sampler.processed_logits(FREQ_LOGITS[None], [FREQ_PARAMS])[0].softmax(-1)
    gen = torch.Generator().manual_seed(3)
    tokens = sampler(FREQ_LOGITS.expand(n, -1), [FREQ_PARAMS] * n, [gen] * n)
    _check_frequencies(tokens, expected, tol=0.04)


# ------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "params",
    [
        SP(),
        SP(temperature=0.0),
        SP(temperature=100.0),
        SP(top_p=1.0, top_k=0, min_p=0.0),
        SP(top_k=-1),
        SP(top_k=50, top_p=1e-6, min_p=1.0),
        SP(repetition_penalty=100.0),
        SP(repetition_penalty=0.01, seed=3),
    ],
)
def test_validate_accepts(params: SamplingParams) -> None:
    validate_sampling(params)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 100.5),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 100.5),
        ("repetition_penalty", float("nan")),
    ],
)
def test_validate_rejects_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        validate_sampling(SP(**{field: value}))


def test_batch_shape_errors() -> None:
    sampler = Sampler()
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="params"):
        sampler(logits, [SP()], [None, None])
    with pytest.raises(ValueError, match="generators"):
        sampler(logits, [SP(), SP()], [None])
    with pytest.raises(ValueError, match="seen"):
        sampler(logits, [SP(), SP()], [None, None], seen_mask([[1]], 5))
    with pytest.raises(ValueError, match="vocab"):
        sampler(torch.zeros(5), [SP()], [None])


# ------------------------------------------------------------- seen tokens
def test_seen_tokens_table_matches_the_histories_step_by_step() -> None:
    """The kept table marks what ``seen_mask`` marks from the whole history, as sequences
    grow, come and go (slots reused, the table grown), and a pending id is marked in the
    step's copy alone."""
    gen = torch.Generator().manual_seed(3)
    table = SeenTokens()
    histories: dict[str, list[int]] = {}
    vocab = 50
    for step in range(40):
        if step % 7 == 0:  # one leaves, two arrive
            if histories:
                gone = sorted(histories)[0]
                table.drop(gone)
                del histories[gone]
            for k in range(2):
                histories[f"r{step}-{k}"] = torch.randint(0, vocab, (5,), generator=gen).tolist()
        keys = sorted(histories)
        tracked = [k if k.endswith("0") else None for k in keys]  # the rest have no penalty
        pending = torch.randint(0, vocab, (len(keys),), generator=gen)
        got = table.mask(tracked, [histories[k] for k in keys], vocab, torch.device("cpu"), pending)
        want = seen_mask([histories[k] + [int(p)] if t else [] for k, t, p in zip(keys, tracked, pending)], vocab)
        assert torch.equal(got, want), step
        for k, p in zip(keys, pending):
            histories[k].append(int(p) if step % 2 else int(torch.randint(0, vocab, (1,), generator=gen)))
    assert len(table.slots) == sum(1 for k in histories if k.endswith("0"))


def test_per_row_values_are_kept_by_value_and_dtype() -> None:
    from mstar.engine.sampler import _on

    cpu = torch.device("cpu")
    a = _on(cpu, [0.5, 1.0], torch.float32)
    assert _on(cpu, [0.5, 1.0], torch.float32) is a  # the next step gets the same tensor
    assert _on(cpu, [1, 1], torch.int64).dtype == torch.int64 and _on(cpu, [1, 1], torch.float32).dtype == torch.float32
    assert _on(cpu, [0.5, 2.0], torch.float32).tolist() == [0.5, 2.0]
