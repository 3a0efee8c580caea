"""The eager generation loop on a tiny random dual AR and codec: a batch gives each request
its solo frames (seeded sampling), ``<|im_end|>`` ends a request without a frame, and the
codec streams the generated frames as it decodes them whole."""

from __future__ import annotations

import torch

from mstar.model.fish_s2_pro.codec import CodecConfig, CodecDecoder, CodecState
from mstar.model.fish_s2_pro.config import DualARConfig
from mstar.model.fish_s2_pro.dual_ar import DualAR
from mstar.model.fish_s2_pro.generate import Sampling, generate
from mstar.model.weights import init_dummy_weights

CONFIG = DualARConfig(vocab_size=96, n_layer=2, n_head=4, n_local_heads=2, dim=32, head_dim=8, intermediate_size=48,
                      codebook_size=16, num_codebooks=4, attention_qk_norm=True, scale_codebook_embeddings=True,
                      norm_fastlayer_input=True, n_fast_layer=2, fast_dim=24, fast_n_head=2, fast_n_local_heads=1,
                      fast_head_dim=12, fast_intermediate_size=40, semantic_begin_id=70, eos_token_id=2)


def model() -> DualAR:
    m = DualAR(CONFIG)
    init_dummy_weights(m, seed=0, std=0.3)
    return m.eval()


def prompt(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 60, (length,), generator=g)
    return tokens, torch.zeros(length, 4, dtype=torch.int64)


def test_batched_requests_equal_their_solo_runs():
    m, prompts, seeds = model(), [prompt(5, 1), prompt(11, 2), prompt(3, 3)], [7, 8, 9]
    with torch.no_grad():  # <|im_end|> now and then: the requests end at different steps
        m.slow.embeddings.weight[CONFIG.eos_token_id] = 0.2 * m.slow.norm.weight
    sampling = Sampling(temperature=1.0, top_p=0.9, top_k=8)
    together = generate(m, prompts, max_frames=6, sampling=sampling, seeds=seeds, page_size=4)
    for p, s, frames in zip(prompts, seeds, together, strict=True):
        solo = generate(m, [p], max_frames=6, sampling=sampling, seeds=[s], page_size=4)[0]
        assert torch.equal(frames, solo)
    assert sorted(len(f) for f in together)[-1] == 6 and len({len(f) for f in together}) > 1


def test_stops_at_im_end():
    m = model()
    with torch.no_grad():  # make <|im_end|> win the slow step: it is never a frame
        m.slow.embeddings.weight[CONFIG.eos_token_id] = 50 * m.slow.norm.weight
    frames = generate(m, [prompt(5, 1)], max_frames=6)[0]
    assert frames.shape == (0, 4)


def test_generated_frames_stream_through_the_codec():
    m = model()
    frames = generate(m, [prompt(7, 4)], max_frames=6)[0]
    codec = CodecDecoder(CodecConfig(latent_dim=32, decoder_dim=16, decoder_rates=(2, 2), semantic_codebook_size=16,
                                     codebook_size=16, n_codebooks=3, codebook_dim=4, downsample_factor=(2,),
                                     n_layer=1, n_head=2, head_dim=16, intermediate_size=32, window_size=3))
    init_dummy_weights(codec, seed=1, std=0.2)
    codes = frames.t()[None]
    state = CodecState()
    with torch.no_grad():
        whole = codec.decode(codes)
        streamed = torch.cat([codec.step(codes[..., i:i + 1], state) for i in range(codes.shape[-1])], dim=-1)
    assert whole.shape == (1, len(frames) * 8)
    assert (streamed - whole).abs().max() <= 1e-4 * whole.abs().max()


def test_pick_follows_fish_speech_top_p_and_top_k():
    from mstar.model.fish_s2_pro.generate import pick

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen = {pick(logits, torch.Generator().manual_seed(s), Sampling(temperature=1.0, top_p=0.7, top_k=30))
            for s in range(200)}
    assert seen == {0}  # 0.5 + 0.3 passes 0.7 at the second token: it is dropped, the first kept
    seen = {pick(logits, torch.Generator().manual_seed(s), Sampling(temperature=1.0, top_p=0.95, top_k=2))
            for s in range(200)}
    assert seen == {0, 1}


def test_repetition_aware_sampling_redraws_a_recent_semantic_token():
    from collections import deque

    from mstar.model.fish_s2_pro.generate import pick_slow

    logits = torch.full((20,), -5.0)
    logits[12], logits[13], logits[14] = 3.0, 2.9, 2.8  # the ordinary draw (top-p 0.1) is always 12
    sampling = Sampling(temperature=1.0, top_p=0.1, top_k=30)
    semantic = range(10, 20)
    draws = {pick_slow(logits, torch.Generator().manual_seed(s), sampling, deque([12]), semantic) for s in range(100)}
    assert draws == {12, 13}  # 12 repeats: the fallback draw is taken (top-p 0.9 keeps 12 and 13)
    draws = {pick_slow(logits, torch.Generator().manual_seed(s), sampling, deque([11]), semantic) for s in range(50)}
    assert draws == {12}
