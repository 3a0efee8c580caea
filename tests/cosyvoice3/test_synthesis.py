"""CosyVoice3's walk (``mstar.model.cosyvoice3.synthesis``) on tiny dummy weights, CPU: the LM
driver's paged decode samples what a cache-free recompute samples with the same seed, and the
streamed audio (flow chunks as the reference's driver plans them, then the causal HiFT on the
mel so far) joins up to the whole decode."""

from __future__ import annotations

import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.cosyvoice3 import RasParams, SpeechLM, StreamPlanner, length_bounds, sample_speech_token
from mstar.model.cosyvoice3.synthesis import VoicePrompt, speech_tokens, stream_audio, whole_audio
from tests.support.pages import Pages


def recomputed_tokens(lm: SpeechLM, text_ids: torch.Tensor, prompt: VoicePrompt, seed: int) -> list[int]:
    """The LM decode without a cache: every step prefills the whole sequence afresh."""
    generator = torch.Generator().manual_seed(seed)
    min_len, max_len = length_bounds(lm.config, len(text_ids))
    prefix = lm.prompt_ids(torch.cat([prompt.text_ids, text_ids]), prompt.speech)
    tokens: list[int] = []
    with torch.no_grad():
        for step in range(max_len):
            caches = allocate_kv_cache(*[lm.cache_shape()[0], 64, 4, *lm.cache_shape()[1:]], torch.float32,
                                       torch.device("cpu"))
            ids = torch.cat([prefix, torch.tensor(tokens, dtype=torch.long)])
            hidden = lm(ids, Pages(64, 4).step([("a", ids.shape[0])]), caches)
            logp = lm.compute_logits(hidden[-1:]).log_softmax(-1)[0]
            token = sample_speech_token(logp, tokens, RasParams(), generator,
                                        banned=lm.config.stop_ids if step < min_len else ())
            if token in lm.config.stop_ids:
                break
            tokens.append(token)
    return tokens


def test_paged_lm_driver_samples_as_a_cache_free_recompute(parts) -> None:
    lm, _, _, prompt = parts
    text = torch.tensor([20, 21, 22])
    got = list(speech_tokens(lm, text, prompt, torch.Generator().manual_seed(5), silent=frozenset()))
    want = recomputed_tokens(lm, text, prompt, seed=5)
    min_len, max_len = length_bounds(lm.config, len(text))
    assert min_len <= len(got) <= max_len and got == want


def test_streamed_audio_joins_to_the_whole(parts) -> None:
    lm, flow, hift, prompt = parts
    tokens = list(speech_tokens(lm, torch.arange(20, 30), prompt, torch.Generator().manual_seed(7),
                                silent=frozenset()))
    assert len(tokens) >= 20
    planner = StreamPlanner(prompt_tokens=len(prompt.speech), hop=4, max_hop=8)  # chunks of 8 frames = 4 tokens
    pieces = list(stream_audio(flow, hift, iter(tokens), prompt, planner))
    whole = whole_audio(flow, hift, tokens, prompt)
    joined = torch.cat(pieces)
    assert len(pieces) >= 3 and all(p.numel() for p in pieces[:-1])
    assert joined.shape == whole.shape
    err = ((joined - whole).abs().max() / whole.abs().max()).item()
    print(f"[stream] {len(pieces)} pieces, joined vs whole: {err:.2e} of peak")
    assert err <= 1e-5
