"""T3 at the real sizes with dummy weights (``load_format: dummy``): the released shapes
build, fill and decode a few guided steps on the CPU (bfloat16, to keep it to a minute)."""

from __future__ import annotations

import pytest
import torch

from mstar.contract import SamplingParams
from mstar.model.chatterbox.conditioning import T3Conditioning
from mstar.model.chatterbox.config import T3Config
from mstar.model.chatterbox.t3_checkpoint import load_t3
from mstar.model.chatterbox.t3_decode import PagedSequences, T3Request, generate
from mstar.model.chatterbox.text import t3_text_ids


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["english", "multilingual", "turbo"])
def test_real_size_dummy_decode(variant):
    config = T3Config.for_variant(variant)
    model = load_t3(None, config, dummy=True, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    cond = T3Conditioning(torch.randn(1, config.speaker_embed_size, generator=gen),
                          torch.randint(0, 6561, (1, config.speech_cond_prompt_len), generator=gen), 0.5)
    text = torch.tensor(t3_text_ids(list(range(1, 40)), config))
    request = T3Request(cond, text, SamplingParams(temperature=0.0), cfg_weight=0.5, max_new_tokens=3)
    result = generate(model, request, PagedSequences(model, num_pages=64, page_size=16, dtype=torch.bfloat16))
    assert len(result.tokens) >= 1
    assert all(0 <= t < config.speech_vocab_size for t in result.tokens)
    assert result.logits[0].shape == ((2 if config.guided else 1), config.speech_vocab_size)
    assert torch.isfinite(result.logits[0].float()).all()
