"""The CTC node: a step's clips of different lengths, packed into length-sorted forwards
under the padded-seconds budget, each get their solo per-frame ids; the text stream decodes
them as the vocabulary does."""

from __future__ import annotations

import torch

from mstar.engine.base import EngineItem
from mstar.model.omniasr.engine import ctc_fn
from mstar.model.omniasr.model import CtcTextStream
from mstar.model.omniasr.modeling import OmniAsrCtc, normalize_utterance
from mstar.model.omniasr.vocabulary import CtcVocabulary
from tests.model.omniasr.test_omniasr_checkpoint import random_model


def items(clips):
    return [EngineItem(f"r{i}", "forward", 0, {"waveform": normalize_utterance(c)}, {}) for i, c in enumerate(clips)]


@torch.no_grad()
def test_batched_forwards_give_each_clip_its_solo_ids(monkeypatch):
    model = random_model(seed=2)
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(n, generator=g) for n in (3000, 8000, 1200, 5000, 6100)]
    forwards = []
    original = OmniAsrCtc.forward

    def counting(self, waves, lengths=None):
        forwards.append(tuple(waves.shape))
        return original(self, waves, lengths)

    monkeypatch.setattr(OmniAsrCtc, "forward", counting)
    run = ctc_fn(model, max_batch_size=8, max_batch_seconds=1.0)  # 16,000 padded samples a forward
    together = run("forward", items(clips))
    assert forwards == [(2, 8000), (3, 5000)]  # 8000 + 6100, then 5000 + 3000 + 1200
    forwards.clear()
    alone = [run("forward", items([c]))[0] for c in clips]
    assert len(forwards) == 5
    for a, b in zip(together, alone):
        assert a["frame_ids"].tolist() == b["frame_ids"].tolist()
        assert len(a["frame_ids"]) > 0


def test_exact_float32_restores_the_tf32_switches():
    from mstar.model.omniasr.engine import exact_float32

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with exact_float32(True):
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_text_stream_collapses_and_drops_blanks():
    vocab = CtcVocabulary.synthetic(12)
    stream = CtcTextStream(vocab)
    event = stream.feed("text", torch.tensor([0, 4, 4, 0, 4, 5, 5, 2, 0]))
    assert event.token_ids == [4, 4, 5, 2] and event.text == vocab.decode([0, 4, 4, 0, 4, 5, 5, 2, 0])
    assert stream.generated == 4
