"""Qwen3-Omni speech out end to end against transformers' whole
``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`` on a tiny random config
(fp32, CPU, greedy everywhere): the thinker's text, the talker's codes and the waveform of
``speak``; the talker prompt's rows against the reference's user and assistant parts; the
thinker's kept hidden states against its ``hidden_states``."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_omni_moe")

from mstar.model.qwen3_omni import Qwen3OmniTextConfig, Qwen3OmniThinkerForCausalLM  # noqa: E402
from mstar.model.qwen3_omni.checkpoint import load_code2wav, load_talker, load_thinker_text  # noqa: E402
from mstar.model.qwen3_omni.code2wav import Qwen3OmniCode2Wav, Qwen3OmniCode2WavConfig  # noqa: E402
from mstar.model.qwen3_omni.speech import (  # noqa: E402
    ChatTokens,
    run_thinker,
    speak,
    talker_prompt,
    user_rows,
)
from mstar.model.qwen3_omni.talker import Qwen3OmniTalker  # noqa: E402
from tests.support.qwen3_omni import (  # noqa: E402
    ACCEPT_HIDDEN_LAYER,
    AUDIO_TOKEN,
    CHAT,
    NEWLINE,
    TALKER,
    reference_omni,
    released_code2wav_keys,
    released_keys,
    talker_released_keys,
)

TOKENS = ChatTokens(im_start=CHAT["im_start_token_id"], im_end=CHAT["im_end_token_id"],
                    user=CHAT["user_token_id"], assistant=CHAT["assistant_token_id"],
                    tts_pad=CHAT["tts_pad_token_id"], tts_bos=CHAT["tts_bos_token_id"],
                    tts_eos=CHAT["tts_eos_token_id"], audio=AUDIO_TOKEN, image=151, video=152)
SPEAKER = "tiny"
START, END = CHAT["im_start_token_id"], CHAT["im_end_token_id"]
# system turn, user turn, the assistant's opening (the chat template's layout)
PROMPT = [START, CHAT["system_token_id"], NEWLINE, 5, 6, END, NEWLINE,
          START, CHAT["user_token_id"], NEWLINE, 10, 20, 30, 40, END, NEWLINE,
          START, CHAT["assistant_token_id"], NEWLINE]
# the tiny talker's codes are 0 .. 39 (the code predictor's vocabulary): the reference's rule
# (the top 1024 ids) would mask the whole tiny vocabulary but the EOS, so both get this list
SUPPRESSED = [i for i in range(40, 96) if i != TALKER["codec_eos_token_id"]]


@pytest.fixture(scope="module")
def reference():
    return reference_omni()


@pytest.fixture(scope="module")
def ours(reference):
    return build_ours(reference)


@pytest.fixture(scope="module")
def stopping():
    """A reference whose talker draws the codec EOS after 5 frames (its codec-head row for the
    EOS scaled by 2.5; random weights alone never draw it mid-clip), and ours from it."""
    reference = reference_omni()
    with torch.no_grad():
        reference.talker.codec_head.weight[TALKER["codec_eos_token_id"]] *= 2.5
    return reference, build_ours(reference)


def build_ours(reference):
    d = reference.config.to_dict()
    thinker = Qwen3OmniThinkerForCausalLM(Qwen3OmniTextConfig.from_hf_dict(d)).eval()
    load_thinker_text(thinker, released_keys(reference.thinker))
    talker = Qwen3OmniTalker.from_hf_dict(d).eval()
    load_talker(talker, talker_released_keys(reference.talker))
    code2wav = Qwen3OmniCode2Wav(Qwen3OmniCode2WavConfig.from_hf_dict(d)).eval()
    load_code2wav(code2wav, released_code2wav_keys(reference.code2wav))
    return thinker, talker, code2wav


def test_config_from_whole_dict(reference, ours) -> None:
    assert ours[1].config.accept_hidden_layer == ACCEPT_HIDDEN_LAYER
    # the config names no <|im_end|>: the released id stays (the reference's default thinker EOS)
    assert ChatTokens.from_hf_dict(reference.config.to_dict()) == replace(TOKENS, im_end=151645)


@torch.no_grad()
def test_thinker_keeps_the_accepted_layer(reference, ours) -> None:
    """The kept states equal transformers' ``hidden_states[k]`` for every k (0: embeddings,
    the last: final-normed), over the prompt and the generated tokens."""
    thinker = ours[0]
    want = reference.thinker.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=3, do_sample=False,
                                      eos_token_id=END, output_hidden_states=True, return_dict_in_generate=True)
    for layer in range(thinker.text_config.num_hidden_layers + 1):
        run = run_thinker(thinker, PROMPT, 3, [END], layer)
        assert run.generated == want.sequences[0, len(PROMPT):].tolist()
        ref = torch.cat([h[layer][0] for h in want.hidden_states])
        torch.testing.assert_close(run.hidden, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run.embeds, torch.cat([h[0][0] for h in want.hidden_states]))


@torch.no_grad()
def test_talker_prompt_rows_match_reference_parts(reference, ours) -> None:
    """User rows (an audio token through ``hidden_projection``) and the assistant's 9 rows and
    trailing text rows against ``_get_talker_user_parts`` / ``_get_talker_assistant_parts``."""
    talker = ours[1]
    prompt = PROMPT[:11] + [AUDIO_TOKEN] + PROMPT[11:]  # an audio token in the user turn
    generated = [7, 8, 9, 11, END]
    n = len(prompt) + len(generated) - 1
    gen = torch.Generator().manual_seed(11)
    embeds, hidden = torch.randn(n, 64, generator=gen), torch.randn(n, 64, generator=gen)
    tts = torch.randn(3, 64, generator=gen)
    got = talker_prompt(talker, TOKENS, TALKER["speaker_id"][SPEAKER], prompt, generated, embeds, hidden, tts)

    users = user_rows(prompt, TOKENS)
    assert users == list(range(7, 17))  # <|im_start|>user .. <|im_end|>\n
    ids = torch.tensor([prompt + generated[:-1]])
    mm = ids == AUDIO_TOKEN
    user = reference._get_talker_user_parts(0, len(prompt), mm, hidden[None], embeds[None])[0, users]
    pad, bos, eos = (reference.talker.text_projection(tts[i]) for i in (2, 0, 1))
    a = len(prompt) - 3
    assistant, _, trailing = reference._get_talker_assistant_parts(
        a, n + 1, TALKER["speaker_id"][SPEAKER], embeds[None], pad[None, None], bos[None, None], eos[None, None])
    torch.testing.assert_close(got.embeds, torch.cat((user, assistant[0])), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.trailing, trailing[0], rtol=1e-6, atol=1e-6)
    # e(a + 4) .. : the answer's ids 1 .. G - 2 (the EOS never ran), then tts_eos
    assert got.embeds.shape == (len(users) + 9, 64) and got.trailing.shape == (len(generated) - 1, 64)
    torch.testing.assert_close(got.text_row(99), pad, rtol=1e-6, atol=1e-6)

    with pytest.raises(NotImplementedError, match="image"):
        talker_prompt(talker, TOKENS, 94, PROMPT[:11] + [TOKENS.image] + PROMPT[11:], generated, embeds, hidden, tts)
    with pytest.raises(ValueError, match="too short"):
        talker_prompt(talker, TOKENS, 94, PROMPT, [7], embeds, hidden, tts)
    with pytest.raises(ValueError, match="assistant"):
        talker_prompt(talker, TOKENS, 94, PROMPT[:-3], generated, embeds, hidden, tts)


@torch.no_grad()
@pytest.mark.parametrize("text_tokens, frames, eos, stops", [(6, 8, END, False), (3, 12, END, False),
                                                             (6, 30, 74, True)])
def test_speak_matches_generate(request, text_tokens: int, frames: int, eos: int, stops: bool,
                                monkeypatch) -> None:
    """Greedy thinker, talker and code predictor, then code2wav's chunked decode. The reference's
    ``talker_max_new_tokens = M`` gives ``M - 1`` frames (the last code 0 drawn has no frame),
    so it runs with ``frames + 1``; the (3, 12) case runs out of answer text (trailing rows then
    ``tts_pad``). The last case stops on both EOS: the thinker's (74 is its 4th greedy id here)
    and the codec's (after 5 frames)."""
    if stops:
        reference, ours = request.getfixturevalue("stopping")
    else:
        reference, ours = request.getfixturevalue("reference"), request.getfixturevalue("ours")
    thinker, talker, code2wav = ours
    seen: list[torch.Tensor] = []  # the codes the reference decodes (its generate returns text and wav only)
    decode = reference.code2wav.chunked_decode

    def spy(codes: torch.Tensor, **kwargs) -> torch.Tensor:
        seen.append(codes)
        return decode(codes, **kwargs)

    monkeypatch.setattr(reference.code2wav, "chunked_decode", spy)
    t0 = time.perf_counter()
    want_ids, want_wav = reference.generate(
        input_ids=torch.tensor([PROMPT]), speaker=SPEAKER, return_audio=True, thinker_max_new_tokens=text_tokens,
        thinker_eos_token_id=eos, thinker_do_sample=False, talker_do_sample=False,
        talker_max_new_tokens=frames + 1, talker_repetition_penalty=1.0, talker_suppress_tokens=SUPPRESSED)
    t1 = time.perf_counter()
    got = speak(thinker, talker, code2wav, PROMPT, TOKENS, TALKER["speaker_id"][SPEAKER],
                max_new_tokens=text_tokens, max_frames=frames, eos_token_ids=[eos], suppressed=SUPPRESSED,
                page_size=4)
    t2 = time.perf_counter()
    assert got.text_ids == want_ids[0, len(PROMPT):].tolist()
    (want_codes,) = seen
    assert torch.equal(got.codes, want_codes[0])
    assert got.codes.shape == (TALKER["num_code_groups"], 5 if stops else frames)
    assert (got.text_ids[-1] == eos) == stops and len(got.text_ids) == (4 if stops else text_tokens)
    want_wav = want_wav.reshape(-1)
    assert got.waveform.shape == want_wav.shape
    err = ((got.waveform - want_wav).abs().max() / want_wav.abs().max()).item()
    assert err < 1e-5, f"waveform rel err {err:.2e}"
    print(f"[parity] qwen3-omni speech: {len(got.text_ids)} text ids, codes {tuple(got.codes.shape)}, "
          f"{got.waveform.numel()} samples, wav rel err {err:.2e}; reference {t1 - t0:.2f} s, ours {t2 - t1:.2f} s")


@torch.no_grad()
def test_codec_eos_first_gives_silence() -> None:
    """A talker whose first code 0 is the codec EOS: no frames and an empty waveform (the
    reference's ``generate`` fails there, stacking no frames)."""
    reference = reference_omni()
    with torch.no_grad():
        reference.talker.codec_head.weight[TALKER["codec_eos_token_id"]] *= 5.0
    thinker, talker, code2wav = build_ours(reference)
    got = speak(thinker, talker, code2wav, PROMPT, TOKENS, TALKER["speaker_id"][SPEAKER], max_new_tokens=4,
                max_frames=10, suppressed=SUPPRESSED)
    assert got.codes.shape == (TALKER["num_code_groups"], 0) and got.waveform.shape == (0,)
    assert len(got.text_ids) == 4
