"""The S3 speech tokenizer (``mstar.model.speech_front.s3_tokenizer``) against the
``s3tokenizer`` package.

The reference outputs are in ``fixtures/s3_tokenizer.pt``, recorded by ``record_reference.py``
with ``s3tokenizer==0.3.0`` on ``torch==2.9.1`` / ``torchaudio==2.9.1`` (the package imports
torchaudio and onnx at module level, so it does not import beside our torch). Tiny random
configs (128 wide, two 64-channel heads; v2 with 2 blocks, v3 with 1), float32 on the CPU, the
weights drawn by ``tests/support/speech_front.seeded_state`` on both sides.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.model.speech_front import S3Tokenizer, S3TokenizerConfig, log_mel, s3_tokenizer_name_map
from mstar.model.weights import WeightLoadError, load_weights
from tests.support.speech_front import FIXTURES, clips, long_clip, max_rel_error, seeded_state

REF = torch.load(FIXTURES / "s3_tokenizer.pt")
MEL_TOL = 1e-5  # of the reference's peak
HIDDEN_TOL = 1e-5


def tiny(name: str) -> S3Tokenizer:
    case = REF[name]
    model = S3Tokenizer(S3TokenizerConfig(d_model=128, n_heads=2, n_layers=case["layers"])).eval()
    load_weights(model, seeded_state(case["keys"], seed=1).items())  # strict: coverage both ways
    return model


def test_log_mel_matches_the_package():
    for wave, ref in zip(clips(), REF["log_mel"], strict=True):
        ours = log_mel(wave)
        assert ours.shape == ref.shape
        err = max_rel_error(ours, ref)
        assert err < MEL_TOL, f"log-mel max error {err:.2e}"


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_hidden_states_and_tokens_match(name):
    model, case = tiny(name), REF[name]
    mel, lengths = model.features(clips())
    hidden, counts = model.encode(mel, lengths)
    assert counts.tolist() == case["hidden_len"].tolist()
    for row, n in enumerate(counts.tolist()):  # the frames past a clip's end are padding
        err = max_rel_error(hidden[row, :n], case["hidden"][row, :n])
        assert err < HIDDEN_TOL, f"{name} clip {row}: pre-quantiser max error {err:.2e}"
    tokens, token_counts = model(clips())
    assert token_counts.tolist() == case["token_len"].tolist()
    for row, n in enumerate(token_counts.tolist()):
        assert torch.equal(tokens[row, :n], case["tokens"][row, :n].long())
        assert not tokens[row, n:].any()


def test_prompt_cut_matches_the_package():
    """``max_tokens`` cuts the features before the encoder (Chatterbox's T3 prompt), so the
    tokens differ from a prefix of the whole clip's."""
    tokens, counts = tiny("v2")(clips(), max_tokens=10)
    ref = REF["v2"]
    assert counts.tolist() == ref["prompt_len"].tolist()
    assert torch.equal(tokens, ref["prompt_tokens"].long())


def test_clip_over_30_s_is_windowed_like_the_package():
    waves = clips()
    tokens, counts = tiny("v2")([long_clip(waves[0], REF["long"]["seconds"]), waves[1]])
    ref = REF["long"]
    assert counts.tolist() == ref["token_len"].tolist()
    assert counts[0] > 25 * 50  # three windows
    for row, n in enumerate(counts.tolist()):
        assert torch.equal(tokens[row, :n], ref["tokens"][row, :n].long())


def test_loads_chatterbox_layout_and_names_mismatches(tmp_path):
    """Chatterbox's ``s3gen.safetensors`` keeps the tokenizer under ``tokenizer.``, next to
    other modules' tensors, with its mel filterbank and window buffers."""
    state = {f"tokenizer.{k}": v for k, v in seeded_state(REF["v2"]["keys"], seed=1).items()}
    state["tokenizer._mel_filters"] = torch.zeros(128, 201)
    state["tokenizer.window"] = torch.zeros(400)
    state["flow.input_embedding.weight"] = torch.zeros(4, 4)
    save_file(state, tmp_path / "s3gen.safetensors")
    model = S3Tokenizer(S3TokenizerConfig(d_model=128, n_heads=2, n_layers=2)).eval()
    load_weights(model, load_file(tmp_path / "s3gen.safetensors").items(), name_map=s3_tokenizer_name_map("tokenizer."))
    tokens, counts = model(clips())
    assert counts.tolist() == REF["v2"]["token_len"].tolist()
    inside = torch.arange(tokens.shape[1])[None, :] < counts[:, None]
    assert torch.equal(tokens[inside], REF["v2"]["tokens"].long()[inside])

    del state["tokenizer.encoder.blocks.1.attn.fsmn_block.weight"]
    state["tokenizer.encoder.blocks.1.attn.fsmn.weight"] = torch.zeros(1)
    with pytest.raises(WeightLoadError, match=r"blocks\.1\.attn\.fsmn_block\.weight.*blocks\.1\.attn\.fsmn\.weight"):
        load_weights(model, state.items(), name_map=s3_tokenizer_name_map("tokenizer."))


@pytest.mark.slow
def test_released_size_matches():
    """v2 at the released size (1280 wide, 20 heads, 6 blocks) with random weights, one clip:
    the 64-channel rotary heads and the masks at full width. With these weights every frame
    quantises to the same code, so the hidden states carry this check."""
    ref = torch.load(FIXTURES / "s3_tokenizer_full.pt")
    model = S3Tokenizer().eval()
    load_weights(model, seeded_state(REF["v2"]["released_keys"], seed=5).items())
    mel, lengths = model.features(clips()[1:2])
    hidden, _ = model.encode(mel, lengths)
    err = max_rel_error(hidden, ref["hidden"])
    assert err < HIDDEN_TOL, f"pre-quantiser max error {err:.2e}"
    assert torch.equal(model.quantizer(hidden), ref["tokens"].long())


@pytest.mark.parametrize("name,config", [("v2", S3TokenizerConfig()), ("v3", S3TokenizerConfig.v3())])
def test_released_geometry_has_the_released_keys(name, config):
    """Our parameters at the released size are exactly the package's state dict, shapes too."""
    with torch.device("meta"):
        model = S3Tokenizer(config)
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == REF[name]["released_keys"]


def test_too_short_clip_is_refused_by_name():
    with pytest.raises(ValueError, match="too short to tokenize"):
        tiny("v2")([torch.zeros(100)])
