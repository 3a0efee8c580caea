"""T3 against the reference package, on tiny random configs, float32 on the CPU.

The reference (chatterbox-tts 0.1.7) pins torch 2.6 and transformers 5.2 and cannot be
imported beside the project's; its outputs were recorded once by ``record_reference.py`` (next
to this file, which says how to re-record) and are compared here. Each variant's fixture holds
the reference T3's weights in the released key layout (loaded through ``load_t3``, coverage
checked both ways), its conditioning rows, prefill embeddings, the speech logits of every
forward of a short greedy decode (rows ``[cond, uncond]`` for the guided variants) and the
tokens it drew (repetition penalty 1.2, so the penalty's history counts).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from mstar.contract import SamplingParams
from mstar.model.chatterbox.conditioning import T3Conditioning
from mstar.model.chatterbox.t3_checkpoint import T3_FILES, load_t3
from mstar.model.chatterbox.t3_decode import PagedSequences, T3Request, generate
from tests.chatterbox.tiny import FIXTURES, fixture, tiny_config

VARIANTS = ("english", "multilingual", "turbo")


@pytest.fixture(scope="module", params=VARIANTS)
def case(request, tmp_path_factory):
    variant = request.param
    directory = tmp_path_factory.mktemp(variant)
    shutil.copy(FIXTURES / f"t3_{variant}.safetensors", directory / T3_FILES[variant])
    model = load_t3(directory, tiny_config(variant))
    ref = fixture(variant)
    cond = T3Conditioning(ref["speaker_emb"], ref["cond_prompt_speech_tokens"], float(ref["emotion_adv"]))
    return variant, model, ref, cond


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_conditioning_rows(case):
    _, model, ref, cond = case
    with torch.inference_mode():
        ours = model.conditioning(cond)
    assert ours.shape == ref["cond_embeds"].shape
    assert _max_err(ours, ref["cond_embeds"]) < 1e-5


def test_prefill_embeddings(case):
    variant, model, ref, cond = case
    guided = model.config.guided
    with torch.inference_mode():
        ours = model.prefill_embeds(model.conditioning(cond), ref["text"][0], guided=guided)
    expected = ref["prefill_embeds"]
    if guided:  # the reference's loop appends a second start-of-speech row
        assert torch.equal(ours[:, -1], ours[:, -2])
        ours = ours[:, :-1]
        # the unconditional row's text is positions only: it differs from the conditional one
        assert _max_err(ours[0], ours[1]) > 0.1
    assert ours.shape == expected.shape
    assert _max_err(ours, expected) < 1e-5


def test_greedy_decode_logits_every_step(case):
    variant, model, ref, cond = case
    steps = ref["tokens"].shape[1]
    request = T3Request(cond=cond, text_ids=ref["text"][0], cfg_weight=float(ref["cfg_weight"]),
                        sampling=SamplingParams(temperature=0.0, repetition_penalty=1.2), max_new_tokens=steps)
    result = generate(model, request, PagedSequences(model, num_pages=16, page_size=4))
    assert result.tokens == ref["tokens"][0].tolist()
    recorded = ref["step_logits"]  # [forwards, rows, V]; the reference also runs one forward past its last draw
    assert len(result.logits) == steps
    errors = [_max_err(ours, recorded[i]) for i, ours in enumerate(result.logits)]
    assert max(errors) < 1e-5, errors
    if model.config.guided:
        assert result.logits[0].shape[0] == 2


SAMPLING = {  # record_reference.py's SAMPLING, seed 1234
    "guided": SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    "turbo": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2),
}


def test_seeded_sampled_decode_draws_the_reference_tokens(case):
    """The reference's filters in its order and its multinomial draw: seeded alike, the same
    tokens (a wrong filter order or penalty history would change the distribution drawn from)."""
    _, model, ref, cond = case
    params = SAMPLING["guided" if model.config.guided else "turbo"]
    expected = ref["sampled_tokens"][0].tolist()
    request = T3Request(cond=cond, text_ids=ref["text"][0], cfg_weight=float(ref["cfg_weight"]),
                        sampling=params, max_new_tokens=len(expected))
    generator = torch.Generator().manual_seed(1234)
    result = generate(model, request, PagedSequences(model, num_pages=16, page_size=4), generator)
    assert result.tokens == expected


def test_the_multilingual_guard_forced_the_recorded_stop():
    """The recorded seeded multilingual decode ends where the reference's alignment guard forced
    the stop token (two equal tokens in a row): the guard, not the draw, ended it."""
    tokens = fixture("multilingual")["sampled_tokens"][0].tolist()
    stop = tiny_config("multilingual").stop_speech_token
    assert tokens[-1] == stop and tokens[-2] == tokens[-3]
