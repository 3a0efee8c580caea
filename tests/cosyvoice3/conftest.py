"""Shared fixtures of the CosyVoice3 tests: the reference recordings (``record_reference.py``)
and a tiny dummy-weight family for the walk and engine tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mstar.model.cosyvoice3 import CosyVoice3Flow, DiTConfig, FlowConfig, SpeechLM, SpeechLMConfig, qwen2_config
from mstar.model.cosyvoice3.synthesis import VoicePrompt
from tests.model.test_hift_causal import CAUSAL, causal_generator

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def reference() -> dict:
    return torch.load(FIXTURES / "reference.pt")


SPEECH = 48
END_OF_PROMPT = 9


@pytest.fixture(scope="module")
def parts() -> tuple[SpeechLM, CosyVoice3Flow, torch.nn.Module, VoicePrompt]:
    torch.manual_seed(0)
    backbone = qwen2_config(dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2))
    lm = SpeechLM(SpeechLMConfig(backbone=backbone, speech_token_size=SPEECH, endofprompt_id=END_OF_PROMPT)).eval()
    with torch.no_grad():
        lm.llm_decoder.weight[SPEECH:] *= 0.1  # dummy weights: keep stop tokens from winning at once
    dit = DiTConfig(dim=32, depth=2, heads=4, head_dim=8, static_chunk_size=8)
    flow = CosyVoice3Flow(FlowConfig(vocab_size=SPEECH, speaker_dim=16, lookahead_channels=24, dit=dit)).eval()
    hift = causal_generator(replace(CAUSAL, in_channels=80)).eval()
    g = torch.Generator().manual_seed(1)
    prompt = VoicePrompt(text_ids=torch.tensor([3, 4, END_OF_PROMPT]),
                         speech=torch.randint(0, SPEECH, (6,), generator=g),
                         mel=torch.randn(12, 80, generator=g), xvector=torch.randn(16, generator=g))
    return lm, flow, hift, prompt
