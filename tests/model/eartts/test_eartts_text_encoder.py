"""The talker's text table from the checkpoint's character-aware encoder, against NeMo's
``CharAwareSubwordEncoder`` (fixture from ``record_reference.py``: a made-up 20-token
tokenizer, a two-layer T5-Gemma encoder; fp32, CPU)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from mstar.model.eartts.checkpoint import EarTTS, load_checkpoint
from mstar.model.eartts.config import EarTTSConfig
from mstar.model.eartts.text_encoder import char_map
from mstar.model.weights import WeightLoadError
from tests.model.eartts.eartts_fixture import reference

TEXT_FIXTURE = Path(__file__).parent / "fixtures" / "eartts_text_reference.pt"


def _model_and_state():
    ref, text = reference(), torch.load(TEXT_FIXTURE, weights_only=True)
    config = copy.deepcopy(ref["config"])
    config["model"]["tts_config"]["cas_config"] = text["cas_config"]
    model = EarTTS(EarTTSConfig.from_speech_generation(config))
    return model, {**ref["state"], **text["state"]}, text


def test_text_table_matches_reference():
    model, state, text = _model_and_state()
    vocab = {tok: i for i, tok in enumerate(text["tokens"])}
    extras = load_checkpoint(model, state.items(), vocab=vocab)
    assert extras.text_encoder  # the encoder's tensors, run once and not kept
    table = model.talker.text
    rows = len(vocab)
    assert table.on.shape[0] == rows + 1
    torch.testing.assert_close(table.on[:rows], text["spoken"], atol=1e-5, rtol=0)
    mask = text["mask"]
    ids = torch.arange(rows)
    torch.testing.assert_close(table(ids, mask), text["masked"], atol=1e-5, rtol=0)


def test_char_map_follows_the_single_character_tokens():
    chars, count = char_map({"<s>": 0, "b": 1, "a": 2, "ab": 3, "x?": 4, "\u2581": 5})
    assert count == 3 and chars == {1: (0,), 2: (1,), 3: (1, 0), 5: (2,)}


def test_text_encoder_coverage():
    model, state, text = _model_and_state()
    vocab = {tok: i for i, tok in enumerate(text["tokens"])}
    state = {k: v for k, v in state.items() if not k.endswith("embed_subword.proj_embedding.weight")}
    with pytest.raises(WeightLoadError, match="proj_embedding"):
        load_checkpoint(model, state.items(), vocab=vocab)
