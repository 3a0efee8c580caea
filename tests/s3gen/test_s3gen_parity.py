"""S3Gen (``mstar.model.s3gen``) against Chatterbox's own modules.

The reference outputs are fixtures recorded by ``record_reference.py`` from
``chatterbox-tts==0.1.7`` (``chatterbox.models.s3gen``) on torch 2.13.0 (CPU) with librosa
0.11.0, in a private venv: the package pins torch 2.6 and numpy < 2, so it cannot live in the
project's environment (the script's docstring says how to re-record). The encoder is also
pinned to ``cosyvoice-minicpmo==0.1.0``'s copy, recorded by the same script (its
``cosyvoice.transformer`` imports torchaudio, absent here). Tiny random configs,
float32 on the CPU; errors are relative to the reference's peak.
"""

from __future__ import annotations

import pytest
import torch

from mstar.model.s3gen import S3GenPrompt, UpsampleConformerEncoder, log_mel, mel_filterbank, relative_positions
from mstar.model.weights import load_weights
from tests.s3gen.tiny import encoder_config, fixture, tiny_s3gen
from tests.support.vocoder import peak_err

ENCODER_TOL = 1e-5
MEL_TOL = 1e-5
WAVE_TOL = 1e-4

ENCODER = fixture("encoder")
MEL = fixture("mel")
TOKEN2WAV = fixture("token2wav")
RECORDS = {"s3gen": TOKEN2WAV, "turbo": fixture("turbo")}  # Chatterbox's and Chatterbox Turbo's


def reference_prompt(record: dict) -> S3GenPrompt:
    """The prompt the reference was given, its mel computed by our front from the same clip."""
    return S3GenPrompt(record["prompt_tokens"], log_mel(record["prompt_clip"]).transpose(1, 2), record["xvector"])


def test_encoder_matches_reference():
    """Two rows, one padded: the upsampling conformer's frames and their lengths."""
    encoder = UpsampleConformerEncoder(encoder_config(ENCODER["config"])).eval()
    load_weights(encoder, ENCODER["state"].items())  # strict: every name both ways
    with torch.no_grad():
        frames, lengths = encoder(ENCODER["xs"], ENCODER["lens"])
    assert torch.equal(lengths, ENCODER["masks"][:, 0].sum(-1))
    assert peak_err(frames, ENCODER["out"]) < ENCODER_TOL
    assert peak_err(frames, ENCODER["out_cosyvoice"]) < ENCODER_TOL  # CosyVoice2's copy, same weights


def test_relative_positions_are_the_offsets_sinusoids():
    """Row ``c`` of the table is the sinusoid of offset ``length - 1 - c``; offset 0 is (0, 1, 0, 1...)."""
    table = relative_positions(8, 5)[0]
    assert table.shape == (9, 8)
    assert torch.equal(table[4], torch.tensor([0.0, 1.0] * 4))
    assert torch.allclose(table[0, 0], torch.sin(torch.tensor(4.0)))
    assert torch.allclose(table[8, 0], torch.sin(torch.tensor(-4.0)))
    assert torch.allclose(relative_positions(8, 5, max_positions=3)[0], table, atol=1e-6)  # a short table grows


def test_filterbank_matches_librosa():
    assert torch.equal(mel_filterbank(), MEL["filterbank"]), f"librosa {MEL['librosa']}"


@pytest.mark.parametrize("clip", [0, 1])
def test_prompt_mel_matches_reference(clip):
    """White noise of 0.4 s and a sine of 12345 samples (not a whole number of frames)."""
    ours, ref = log_mel(MEL["clips"][clip]), MEL["mels"][clip]
    assert ours.shape == ref.shape
    # Compared as energies: a bin at the log floor (-11.5) holds float32 FFT noise that the log
    # magnifies to ~1e-2 and that differs between CPUs; the energies agree to ~3e-7 of the peak.
    assert peak_err(ours.exp(), ref.exp()) < MEL_TOL
    assert (ours - ref).abs().max() < 5e-2


def seeded_noise(model, record: dict, prompt: S3GenPrompt) -> torch.Tensor:
    """The flow's starting noise as the reference drew it (the first draws after seeding)."""
    return model.draw_noise(record["tokens"], prompt, torch.Generator().manual_seed(record["seed"]))


@pytest.mark.parametrize("variant", RECORDS)
def test_token2mel_matches_reference(variant):
    """Encoder, flow front, the solve (S3Gen: ten guided cosine-spaced Euler steps; Turbo: two
    mean-flow steps), prompt frames cut (``flow_inference``)."""
    record = RECORDS[variant]
    model = tiny_s3gen(record)
    assert model.config.meanflow == (variant == "turbo")
    prompt = reference_prompt(record)
    with torch.no_grad():
        mel = model.token2mel(record["tokens"], prompt, seeded_noise(model, record, prompt))
    assert mel.shape == (1, 80, 2 * record["tokens"].shape[1])
    assert peak_err(mel, record["mel"]) < MEL_TOL


@pytest.mark.parametrize("variant", RECORDS)
def test_token2wav_matches_reference(variant):
    """The whole ``inference``: flow noise and vocoder source drawn from one seeded generator
    in the reference's order, then the fade-in."""
    record = RECORDS[variant]
    model = tiny_s3gen(record)
    generator = torch.Generator().manual_seed(record["seed"])
    wave = model.token2wav(record["tokens"], reference_prompt(record), generator=generator)
    ref = record["wave"]
    assert ref.abs().max() < 0.5 * model.config.vocoder.audio_limit  # the fixture is not clipped flat
    assert peak_err(wave, ref) < WAVE_TOL
    assert torch.all(wave[:, : model.config.fade_samples] == 0)  # the silenced head


def test_token2wav_depends_on_the_seed():
    """Another seed gives other audio, so the comparison above pins the draws."""
    model = tiny_s3gen(TOKEN2WAV)
    wave = model.token2wav(TOKEN2WAV["tokens"], reference_prompt(TOKEN2WAV),
                           generator=torch.Generator().manual_seed(TOKEN2WAV["seed"] + 1))
    assert peak_err(wave, TOKEN2WAV["wave"]) > 1e-2


def test_rows_of_a_batch_decode_as_alone():
    """Two rows of new tokens after one broadcast prompt, from the same noise: each row's mel
    is its solo decode's (two Euler steps: the rows meet in every estimator call alike)."""
    model = tiny_s3gen(TOKEN2WAV)
    prompt = reference_prompt(TOKEN2WAV)
    tokens = torch.cat([TOKEN2WAV["tokens"], TOKEN2WAV["tokens"].flip(1)])
    noise = seeded_noise(model, TOKEN2WAV, prompt)
    with torch.no_grad():
        both = model.token2mel(tokens, prompt, noise.expand(2, -1, -1), n_cfm_timesteps=2)
        for row in range(2):
            alone = model.token2mel(tokens[row:row + 1], prompt, noise, n_cfm_timesteps=2)
            assert peak_err(both[row:row + 1], alone) < MEL_TOL  # batched matmuls block differently
    assert peak_err(both[:1], both[1:]) > 1e-2


def test_prompt_alignment_drops_tokens_past_the_mel():
    tokens, mel, xvector = torch.arange(7)[None], torch.zeros(1, 11, 80), torch.zeros(1, 12)
    assert S3GenPrompt.aligned(tokens, mel, xvector).tokens.tolist() == [[0, 1, 2, 3, 4]]


def test_noise_of_the_wrong_length_is_refused():
    model = tiny_s3gen(TOKEN2WAV)
    prompt = reference_prompt(TOKEN2WAV)
    with pytest.raises(ValueError, match="noise has"):
        model.token2mel(TOKEN2WAV["tokens"], prompt, torch.zeros(1, 80, 3))


def test_turbo_runs_unguided():
    model = tiny_s3gen(RECORDS["turbo"])
    prompt = reference_prompt(TOKEN2WAV)
    with pytest.raises(ValueError, match="without guidance"):
        model.token2mel(TOKEN2WAV["tokens"], prompt, seeded_noise(model, TOKEN2WAV, prompt), cfg_rate=0.7)


def test_a_meanflow_estimator_needs_the_end_time():
    estimator = tiny_s3gen(RECORDS["turbo"]).estimator
    x = torch.zeros(1, 80, 4)
    with pytest.raises(ValueError, match="end time r"):
        estimator(x, torch.ones(1, 1, 4), torch.zeros(1, 240, 4), torch.zeros(1))


def test_a_padded_row_decodes_as_alone():
    """A row three tokens shorter, padded in a batch with a full one: its frames are its solo
    decode's from the same noise prefix (the padding neither reaches the look-ahead conv nor
    any attention)."""
    model = tiny_s3gen(TOKEN2WAV)
    prompt = reference_prompt(TOKEN2WAV)
    tokens = torch.cat([TOKEN2WAV["tokens"], TOKEN2WAV["tokens"].flip(1)])
    noise = seeded_noise(model, TOKEN2WAV, prompt).expand(2, -1, -1)
    short = tokens.shape[1] - 3
    with torch.no_grad():
        both = model.token2mel(tokens, prompt, noise, token_lengths=torch.tensor([tokens.shape[1], short]),
                               n_cfm_timesteps=2)
        alone = model.token2mel(tokens[1:, :short], prompt, noise[1:, :, :-6], n_cfm_timesteps=2)
        full = model.token2mel(tokens[:1], prompt, noise[:1], n_cfm_timesteps=2)
    assert peak_err(both[1:, :, : 2 * short], alone) < MEL_TOL
    assert peak_err(both[:1], full) < MEL_TOL


def test_a_non_final_decode_holds_back_the_look_ahead_frames():
    """``finalize=False``: the conditioning is the final decode's without the last three
    tokens' frames, and the mel is that many frames shorter."""
    model = tiny_s3gen(TOKEN2WAV)
    prompt, tokens = reference_prompt(TOKEN2WAV), TOKEN2WAV["tokens"]
    held = model.held_frames
    assert held == 6
    with torch.no_grad():
        stack, mask = model.conditioning(tokens, prompt)
        stack_open, mask_open = model.conditioning(tokens, prompt, finalize=False)
        noise = seeded_noise(model, TOKEN2WAV, prompt)[..., :-held]
        assert noise.shape[-1] == model.noise_frames(tokens, prompt, finalize=False)
        mel = model.token2mel(tokens, prompt, noise, finalize=False, n_cfm_timesteps=2)
    assert torch.equal(stack_open, stack[..., :-held]) and torch.equal(mask_open, mask[..., :-held])
    assert mel.shape[-1] == 2 * tokens.shape[1] - held
