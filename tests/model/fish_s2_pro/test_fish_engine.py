"""The served engines on a tiny random dual AR and codec: three requests batched through the
autoregressive engine give each its solo frames from ``generate.py`` (seeded and greedy), and
the codec engine's chunks of new frames equal the whole decode, its per-request state freed
at the last chunk or on release."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mstar.engine.base import EngineItem
from mstar.graph.chunking import Chunk
from mstar.model.fish_s2_pro.codec import CodecConfig, CodecDecoder
from mstar.model.fish_s2_pro.dual_ar import DualAR
from mstar.model.fish_s2_pro.engine import CodecStreams, dual_ar_engine
from mstar.model.fish_s2_pro.generate import Sampling, generate
from mstar.model.weights import init_dummy_weights
from tests.model.fish_s2_pro.test_fish_generate import CONFIG, model, prompt

PAGE = 4


def run_engine(m, prompts, seeds, sampling: dict, max_frames: int, **extra) -> list[torch.Tensor]:
    """Each request's frames ``[F, N]`` from the engine, all requests in every step."""
    engine = dual_ar_engine(m, num_pages=64, page_size=PAGE, max_seq_len=256, device=torch.device("cpu"),
                            dtype=torch.float32)
    params = [{"sampling": {**sampling, "seed": s}, "max_new_tokens": max_frames,
               "stop_token_ids": [CONFIG.eos_token_id], **extra} for s in seeds]
    items = [EngineItem(f"r{i}", "prefill", 0, {"prompt_ids": t, "prompt_codes": k}, params[i])
             for i, (t, k) in enumerate(prompts)]
    frames: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = 0
    while items:
        outs = engine.run(items)
        step += 1
        following = []
        for item, out in zip(items, outs, strict=True):
            i = int(item.request_id[1:])
            if "codes" in out.outputs:
                frames[i].append(out.outputs["codes"][0])
            if "stop" not in out.flags:
                following.append(EngineItem(item.request_id, "decode", step, {"token": out.outputs["token"]},
                                            params[i]))
            else:
                engine.release(item.request_id)
        items = following
    assert engine.pool.num_free_pages == engine.pool.num_pages and not engine.forward.next_codes
    return [torch.stack(f) if f else torch.zeros(0, CONFIG.num_codebooks, dtype=torch.int64) for f in frames]


def s1_model() -> DualAR:
    """The S1 form: the fast AR reads the slow AR's state before the final norm."""
    m = DualAR(replace(CONFIG, norm_fastlayer_input=False, scale_codebook_embeddings=False))
    init_dummy_weights(m, seed=0, std=0.3)
    return m.eval()


@pytest.mark.parametrize(("greedy", "build"), [(False, model), (True, model), (False, s1_model)])
def test_batched_engine_equals_solo_generate(greedy: bool, build):
    m, prompts, seeds = build(), [prompt(5, 1), prompt(11, 2), prompt(3, 3)], [7, 8, 9]
    with torch.no_grad():  # <|im_end|> now and then: the requests end at different steps
        m.slow.embeddings.weight[CONFIG.eos_token_id] = 0.2 * m.slow.norm.weight
    sampling = {"temperature": 0.0} if greedy else {"temperature": 1.0, "top_p": 0.9, "top_k": 8}
    reference = Sampling(greedy=True) if greedy else Sampling(temperature=1.0, top_p=0.9, top_k=8)
    served = run_engine(m, prompts, seeds, sampling, max_frames=6)
    for p, s, frames in zip(prompts, seeds, served, strict=True):
        solo = generate(m, [p], max_frames=6, sampling=reference, seeds=None if greedy else [s], page_size=PAGE)[0]
        assert torch.equal(frames, solo)
    if not greedy:
        assert max(len(f) for f in served) == 6 and len({len(f) for f in served}) > 1


def test_ignore_eos_speaks_the_whole_budget():
    m = model()
    with torch.no_grad():  # make <|im_end|> win every slow step
        m.slow.embeddings.weight[CONFIG.eos_token_id] = 50 * m.slow.norm.weight
    prompts = [prompt(5, 1), prompt(7, 2)]
    assert [len(f) for f in run_engine(m, prompts, [1, 2], {"temperature": 0.0}, max_frames=5)] == [0, 0]
    frames = run_engine(m, prompts, [1, 2], {"temperature": 0.0}, max_frames=5, ignore_eos=True)
    assert [len(f) for f in frames] == [5, 5]


def tiny_codec() -> CodecDecoder:
    codec = CodecDecoder(CodecConfig(latent_dim=32, decoder_dim=16, decoder_rates=(2, 2), semantic_codebook_size=16,
                                     codebook_size=16, n_codebooks=3, codebook_dim=4, downsample_factor=(2,),
                                     n_layer=1, n_head=2, head_dim=16, intermediate_size=32, window_size=3))
    init_dummy_weights(codec, seed=1, std=0.2)
    return codec.eval()


def chunk(index: int, n: int, last: bool) -> Chunk:
    return Chunk(index, 0, n, 0, n, last)


def test_codec_streams_new_frames_against_each_requests_state():
    codec, g = tiny_codec(), torch.Generator().manual_seed(0)
    codes = {rid: torch.randint(0, 16, (7, 4), generator=g) for rid in ("a", "b")}
    engine = CodecStreams(codec)
    pieces: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for index, (lo, hi) in enumerate([(0, 1), (1, 4), (4, 7)]):  # both requests in every batch
        last = hi == 7
        items = [EngineItem(rid, "run", index, {"codes": codes[rid][lo:hi]}, {}, chunk(index, hi - lo, last))
                 for rid in ("a", "b") if not (rid == "b" and last)]
        for item, out in zip(items, engine.run(items), strict=True):
            pieces[item.request_id].append(out.outputs["audio"])
    assert set(engine.states) == {"b"}  # a's last chunk freed its state
    engine.release("b")
    assert engine.stats() == {"codec_streams": 0.0}
    with torch.no_grad():
        whole = codec.decode(codes["a"].T[None])[0]
        whole_b = codec.decode(codes["b"][:4].T[None])[0]
    streamed = torch.cat(pieces["a"])
    assert streamed.shape == whole.shape == (7 * 8,)
    assert (streamed - whole).abs().max() <= 1e-5 * whole.abs().max()
    assert (torch.cat(pieces["b"]) - whole_b).abs().max() <= 1e-5 * whole_b.abs().max()
