"""OmniVoice's engines on the CPU: the packed canvas forward equals the reference's padded one;
several requests step in one backbone forward, each exactly as it steps alone; a full loop
unmasks every cell; the codec node's level and edges."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.base import EngineItem
from mstar.model.omnivoice import Canvas, CanvasPrompt, OmniVoiceBackbone, UnmaskKnobs, tiny_config
from mstar.model.omnivoice.canvas import packed_logits
from mstar.model.omnivoice.engine import EDGE_SECONDS, canvas_fn, finish_audio, unmask_params
from mstar.model.omnivoice.prompt import prompt_row
from tests.support.omnivoice import char_tokenizer

TEXTS = ("Sentence number one", "A second, longer sentence to speak here", "Hi")


@pytest.fixture(scope="module")
def backbone():
    torch.manual_seed(0)
    model = OmniVoiceBackbone(tiny_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def prompts(count: int = 3) -> list[CanvasPrompt]:
    tok, out = char_tokenizer(), []
    for i, text in enumerate(TEXTS[:count]):
        codes = torch.randint(0, 1024, (4, 6), generator=torch.Generator().manual_seed(i)) if i == 1 else None
        row, start = prompt_row(tok, 4, 1024, text, 9 + 4 * i, language="en", ref_text="ref" if i == 1 else None,
                                ref_codes=codes)
        out.append(CanvasPrompt(row, start, 9 + 4 * i))
    return out


def items(ps: list[CanvasPrompt], step: int, knobs: UnmaskKnobs) -> list[EngineItem]:
    return [EngineItem(f"r{i}", "step", step, {"canvas": p.ids},
                       {**unmask_params(knobs, 4, p.target_len), "target_len": p.target_len,
                        "audio_start": p.audio_start, "seed": 100 + i}) for i, p in enumerate(ps)]


@torch.no_grad()
def test_packed_logits_equal_the_padded_canvas(backbone):
    ps = prompts()
    canvas = Canvas.build(ps, 1024)
    padded = backbone(canvas.ids, canvas.audio_mask, canvas.attention_mask)
    for i, (cond, uncond) in enumerate(packed_logits(backbone, ps)):
        ref_cond, ref_uncond = canvas.logits(i, padded)
        assert (cond - ref_cond).abs().max() <= 1e-5 * ref_cond.abs().max()
        assert (uncond - ref_uncond).abs().max() <= 1e-5 * ref_uncond.abs().max()


@torch.no_grad()
def test_requests_step_together_in_one_forward_as_they_do_alone(backbone, monkeypatch):
    knobs = UnmaskKnobs(num_step=4)
    calls = []
    forward = backbone.forward_packed
    monkeypatch.setattr(backbone, "forward_packed", lambda rows, masks: calls.append(len(rows)) or forward(rows, masks))
    run = canvas_fn(backbone, max_batch_size=8)
    ps = prompts()
    for step in range(4):
        batch = items(ps, step, knobs)
        calls.clear()
        together = run("step", batch)
        assert calls == [6]  # three requests, two rows each, one forward
        for item, out in zip(batch, together):
            alone = run("step", [item])[0]
            assert torch.equal(alone["canvas"], out["canvas"])
        ps = [CanvasPrompt(out["canvas"], p.audio_start, p.target_len) for p, out in zip(ps, together)]
    for p in ps:
        assert (p.ids[:, -p.target_len:] != 1024).all()  # every cell revealed
        assert (p.ids[:, :p.audio_start] == p.ids[0, :p.audio_start]).all()  # the text is untouched
    calls.clear()
    canvas_fn(backbone, max_batch_size=2)("step", items(prompts(), 0, knobs))
    assert calls == [4, 2]


def test_finish_audio_levels_and_edges():
    rate = 1000
    edge = int(EDGE_SECONDS * rate)
    wave = torch.ones(400)
    quiet = finish_audio(wave, 0.02, rate)
    assert quiet.shape == (400 + 2 * edge,) and not quiet[:edge].any() and not quiet[-edge:].any()
    assert quiet[edge + 200] == pytest.approx(0.2)  # the clip was raised from 0.02 to 0.1 RMS
    assert quiet[edge] == 0 and quiet[edge + 99] == pytest.approx(0.2)  # a 0.1 s fade in
    loud = finish_audio(3 * wave, 0.5, rate)
    assert loud[edge + 200] == pytest.approx(3.0)
    auto = finish_audio(3 * wave, None, rate)
    assert auto[edge + 200] == pytest.approx(0.5)  # no clip: peak 0.5
