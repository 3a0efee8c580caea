"""OmniVoice's canvas network and unmasking loop against the reference package (omnivoice 0.2.1,
see ``omnivoice_reference.py``): a tiny random ``OmniVoice`` (Qwen3 backbone through
transformers 5) and ours with its weights; the logits on a padded cond/uncond batch, and the
canvas after every unmasking step of ``_generate_iterative`` for a fixed seed (greedy and
sampled, one request and two of different lengths)."""

from __future__ import annotations

import math

import pytest
import torch
from omnivoice_reference import CharTokenizer, reference

from mstar.model.omnivoice import (
    Canvas,
    CanvasPrompt,
    OmniVoiceBackbone,
    UnmaskKnobs,
    denoise,
    tiny_config,
    unmask_counts,
)
from mstar.model.omnivoice.schedule import time_steps


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights large enough that the logits are far from uniform (no near-ties in argmax)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)


@pytest.fixture(scope="module")
def models():
    ref_module = reference()
    config = tiny_config()
    ref_config = ref_module.OmniVoiceConfig(
        audio_vocab_size=config.audio_vocab_size, audio_mask_id=config.audio_mask_id,
        num_audio_codebook=config.num_audio_codebook, llm_config=config.llm.to_hf_dict())
    torch.manual_seed(0)
    ref = ref_module.OmniVoice(ref_config).eval()
    randomize(ref, 1)
    ref.text_tokenizer = CharTokenizer(config.llm.vocab_size)
    ours = OmniVoiceBackbone(config).eval()
    state = {k: v for k, v in ref.state_dict().items() if k != "codebook_layer_offsets"}
    ours.load_state_dict(state, strict=True)
    return ref_module, ref, ours


def task(ref_module, batch: int):
    torch.manual_seed(5)
    refs = [torch.randint(0, 1024, (4, 6)), None]
    return ref_module.GenerationTask(
        batch_size=batch, texts=["hello there", "a much longer sentence to say"][:batch],
        target_lens=[7, 12][:batch], langs=["en", None][:batch], instructs=[None, "female"][:batch],
        ref_texts=["ref words", None][:batch], ref_audio_tokens=refs[:batch], ref_rms=[0.1, None][:batch])


def test_schedule_matches_the_reference(models):
    ref_module = models[0]
    for steps, shift in ((32, 0.1), (8, 1.0), (5, 0.5)):
        expected = ref_module._get_time_steps(num_step=steps, t_shift=shift).tolist()
        assert time_steps(steps, shift) == pytest.approx(expected, abs=0)
        counts = unmask_counts(8 * 7, steps, shift)
        assert sum(counts) == 56 and all(c >= 0 for c in counts)
    # The reference's loop, written out: the first count of 32 steps at shift 0.1.
    t = ref_module._get_time_steps(num_step=32, t_shift=0.1).tolist()
    assert unmask_counts(56, 32, 0.1)[0] == math.ceil(56 * (t[1] - t[0]))


@torch.no_grad()
def test_logits_match_on_a_padded_batch(models):
    ref_module, ref, ours = models
    t = task(ref_module, 2)
    prepared = [ref._prepare_inference_inputs(t.texts[i], t.target_lens[i], t.ref_texts[i],
                                              t.ref_audio_tokens[i], t.langs[i], t.instructs[i])
                for i in range(2)]
    canvas = Canvas.build([prompt_of(p, n) for p, n in zip(prepared, t.target_lens)], 1024)
    torch.manual_seed(3)
    # Reveal about half of each target (audio cells only: text ids must stay in the LLM vocab).
    revealed = (torch.rand(canvas.ids.shape) < 0.5) & canvas.audio_mask[:, None]
    canvas.ids = torch.where(revealed, torch.randint(0, 1024, canvas.ids.shape), canvas.ids)
    expected = ref(input_ids=canvas.ids, audio_mask=canvas.audio_mask,
                   attention_mask=canvas.attention_mask).logits
    got = ours(canvas.ids, canvas.audio_mask, canvas.attention_mask)
    for i in range(2):
        for a, b in zip(canvas.logits(i, got), canvas.logits(i, expected)):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def prompt_of(prepared: dict, target_len: int) -> CanvasPrompt:
    ids, audio = prepared["input_ids"][0], prepared["audio_mask"][0]
    return CanvasPrompt(ids, int(audio.float().argmax()), target_len)


@pytest.mark.parametrize(("batch", "sampled"), [(1, True), (2, True), (2, False)])
@torch.no_grad()
def test_canvas_after_each_step_matches(models, batch, sampled):
    ref_module, ref, ours = models
    t = task(ref_module, batch)
    settings = dict(num_step=6, guidance_scale=2.0, t_shift=0.1, layer_penalty_factor=5.0,
                    position_temperature=5.0 if sampled else 0.0,
                    class_temperature=0.7 if sampled else 0.0)
    seen = []
    forward = ref.forward

    def recording(**kw):
        seen.append(kw["input_ids"].clone())
        return forward(**kw)

    ref.forward = recording
    try:
        torch.manual_seed(11)
        expected = ref._generate_iterative(t, ref_module.OmniVoiceGenerationConfig(**settings))
    finally:
        del ref.forward
    prompts = [prompt_of(ref._prepare_inference_inputs(t.texts[i], t.target_lens[i], t.ref_texts[i],
                                                       t.ref_audio_tokens[i], t.langs[i], t.instructs[i]),
                         t.target_lens[i]) for i in range(batch)]
    canvas = Canvas.build(prompts, 1024)
    assert torch.equal(canvas.ids, seen[0])
    mine = []
    # One generator shared in request order draws what the reference's global one does.
    shared = torch.Generator().manual_seed(11)
    got = denoise(ours, canvas, [UnmaskKnobs(**settings)] * batch, [shared] * batch,
                  on_step=lambda step, c: mine.append(c.ids.clone()))
    assert len(mine) == 6
    for step in range(5):
        assert torch.equal(mine[step], seen[step + 1]), f"canvas differs after step {step}"
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
        assert (a != 1024).all()
