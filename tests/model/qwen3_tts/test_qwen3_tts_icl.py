"""In-context cloning's talker input against the reference (``fixtures/icl.safetensors``,
recorded by ``record_reference.py`` at the reference talker's ``forward`` inside ``generate``,
qwen-tts 0.1.1 under transformers 4.57.3, the weights of ``generate.safetensors``): the
prefill rows (role, codec prefix with the clip's x-vector, then the transcript + text rows
beside the clip's frames), the trailing text rows and the first 3 steps' codebook-0 logits,
for text rows fewer and more than the codec rows and for the non-streaming layout; and the
clip's frames as the codec's context, as the reference decodes a clone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mstar.model.qwen3_tts.checkpoint import load_codec
from mstar.model.qwen3_tts.codec import Qwen3TTSCodec, with_prefix
from mstar.model.qwen3_tts.config import CodecConfig
from mstar.model.qwen3_tts.prompt import talker_prompt
from mstar.model.qwen3_tts.speech import run_talker
from tests.model.qwen3_tts.test_qwen3_tts_generate import recorded  # noqa: F401  (the talker)
from tests.model.qwen3_tts.test_qwen3_tts_parity import AUDIO_TOL, FIXTURES, TOL, read_fixture, rel_err


@pytest.fixture(scope="module")
def icl() -> tuple[dict[str, torch.Tensor], dict, str]:
    with safe_open(FIXTURES / "icl.safetensors", framework="pt") as f:
        meta = f.metadata()
        fx = {k[3:]: f.get_tensor(k) for k in f.keys()}
    return fx, json.loads(meta["cases"]), meta["language"]


@pytest.mark.parametrize("case", ["short_text", "long_text", "non_streaming"])
def test_icl_prompt_and_first_logits_match_reference(recorded, icl, case: str) -> None:  # noqa: F811
    config, talker, _, _ = recorded
    fx, cases, language = icl
    ref_ids = fx["ref_ids"].tolist()  # <|im_start|>assistant\n {ref_text} <|im_end|>\n
    prompt = talker_prompt(talker, config, fx[f"{case}.input_ids"].tolist(), language=language,
                           speaker_embed=fx["x_vector"], non_streaming=cases[case]["non_streaming"],
                           reference=(ref_ids[3:-2], fx["ref_code"]))
    assert prompt.embeds.shape == fx[f"{case}.prompt"].shape
    assert rel_err(prompt.embeds, fx[f"{case}.prompt"]) < TOL
    # the reference hands every trailing row to the talker; past its text they are tts_pad
    trailing = fx[f"{case}.trailing"]
    ours = torch.stack([prompt.text_row(i) for i in range(len(trailing))])
    assert rel_err(ours, trailing) < TOL
    seen: list[torch.Tensor] = []

    def choose(logits: torch.Tensor, step: int) -> torch.Tensor:
        seen.append(logits[0].clone())
        return logits.argmax(-1)

    run_talker(talker, prompt, max_frames=3, choose=choose)
    expected = fx[f"{case}.logits"]
    assert len(seen) == len(expected) == 3
    for ours_step, theirs in zip(seen, expected):
        drawable = torch.isfinite(ours_step)  # the masked ids (specials, early EOS) are -inf here
        assert drawable.sum() > 60
        assert rel_err(ours_step[drawable], theirs[drawable]) < TOL


@torch.no_grad()
def test_clip_frames_are_the_first_windows_context() -> None:
    """The reference decodes an in-context clone as ``[clip frames, new frames]`` and cuts the
    clip's samples; streamed with the clip as ``prefix`` and a left context covering it all,
    the joined windows equal that (the codec fixture's decoder); a shorter left context takes
    only the clip's tail, and without the clip the first audio differs."""
    config, weights, fx = read_fixture("codec")
    codec = Qwen3TTSCodec(CodecConfig.from_hf_dict(config)).eval()
    load_codec(codec, weights.items())
    clip, new = fx["codes"][:1, :, :9], fx["codes"][:1, :, 9:29]
    whole = codec(torch.cat([clip, new], dim=-1))[..., 9 * codec.samples_per_frame:]
    joined = torch.cat(list(codec.decode_stream(new, ramp=(1, 3, 5), left_context=40, prefix=clip)), dim=-1)
    assert rel_err(joined, whole) < AUDIO_TOL
    plain = torch.cat(list(codec.decode_stream(new, ramp=(1, 3, 5), left_context=40)), dim=-1)
    assert rel_err(plain, whole) > 1e-2
    window, context = with_prefix(new[..., :1], 0, clip, left_context=4)
    assert context == 4 and torch.equal(window, torch.cat([clip[..., -4:], new[..., :1]], dim=-1))
    assert with_prefix(new[..., :8], 5, clip, left_context=5)[1] == 5  # a full context takes none
