"""Qwen3-TTS's talker fast path on the CPU: the code predictor's on-device sampling (the
counter-based noise draws the top-50 distribution at temperature 0.9; a row's draw does not
depend on its batch), and the talker engine: 8 seeded requests stepped together equal each
request stepped alone, code for code."""

from __future__ import annotations

import pytest
import torch

from mstar.config import parse_config
from mstar.engine.base import EngineItem
from mstar.model.llama.modeling import LlamaDecoderLayer
from mstar.model.qwen3_tts.checkpoint import Qwen3TTSCheckpoint
from mstar.model.qwen3_tts.codec import stream_windows
from mstar.model.qwen3_tts.engine import CodecEngine, conv_frames, packed_windows, talker_engine
from mstar.model.qwen3_tts.prompt import assistant_text
from mstar.model.qwen3_tts.sampling import draw, mix32, request_key, uniforms
from mstar.model.registry import model_class
from mstar.runtime.protocol import ChunkRef
from tests.support.qwen3_tts_dir import write_checkpoint


def test_mix32_is_lowbias32() -> None:
    """The hash on ints and on int64 tensors equals a plain 32-bit reference implementation."""
    def reference(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    values = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    assert [mix32(v) for v in values] == [reference(v) for v in values]
    assert mix32(torch.tensor(values)).tolist() == [reference(v) for v in values]
    assert request_key(-1) == request_key(2**64 - 1) and request_key(1) != request_key(2)


def test_uniforms_are_uniform_and_keyed() -> None:
    keys = torch.full((4000,), request_key(7))
    frames = torch.arange(4000)
    u = uniforms(keys, frames, 3, 16)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    # another group, frame or key gives other numbers; the same ones give the same
    assert not torch.equal(u, uniforms(keys, frames, 4, 16))
    assert not torch.equal(u, uniforms(keys + 1, frames, 3, 16))
    assert torch.equal(u[10:20], uniforms(keys[10:20], frames[10:20], 3, 16))


def test_draw_follows_the_top_k_distribution() -> None:
    """One logits row drawn at 40 000 counters: codes outside the top 50 never come, and the
    counts of the others pass a chi-square test against softmax(top-50 / 0.9)."""
    torch.manual_seed(0)
    vocab, n = 64, 40_000
    row = torch.randn(vocab) * 1.5
    logits = row.expand(n, vocab)
    keys = torch.full((n,), request_key(11))
    codes = draw(logits, keys, torch.arange(n), 2, torch.zeros(n, dtype=torch.bool))
    top = row.topk(50).indices
    assert torch.isin(codes, top).all()
    probs = torch.softmax(row[top] / 0.9, dim=-1).double()
    counts = torch.bincount(codes, minlength=vocab)[top].double()
    expected = probs * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # 49 degrees of freedom: the 99.9th percentile is about 85.4
    assert chi2 < 85.4, chi2
    # greedy rows take the argmax; a row's draw is the same alone
    greedy = torch.tensor([True, False, True])
    picked = draw(logits[:3], keys[:3], torch.arange(3), 2, greedy)
    assert picked[0] == picked[2] == row.argmax() and picked[1] == codes[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = write_checkpoint(tmp_path_factory.mktemp("qwen3_tts_fast"))
    ckpt = Qwen3TTSCheckpoint.locate(str(root), dummy=True)
    talker = ckpt.talker("cpu", torch.float32, dummy=True, seed=0)
    tokenizer = ckpt.tokenizer()
    return ckpt, talker, tokenizer


def make_engine(tiny, **knobs):
    ckpt, talker, _ = tiny
    return talker_engine(talker, ckpt.config(), num_pages=64, page_size=16, max_seq_len=256,
                         device=torch.device("cpu"), dtype=torch.float32, **knobs)


TEXTS = ["Hello there.", "A second line.", "Three", "Four words go here.", "Five!", "Six and more.",
         "Seven, a longer sentence than the rest.", "Eight"]


def request(tiny, i: int, frames: int = 8) -> EngineItem:
    ckpt, talker, tokenizer = tiny
    ids = tokenizer(assistant_text(TEXTS[i]), add_special_tokens=False)["input_ids"]
    sampling = {"seed": 100 + i} if i % 4 else {"seed": 5, "temperature": 0.0}  # two greedy
    params = {"sampling": sampling, "max_new_tokens": frames, "stop_token_ids": [talker.config.codec_eos_token_id],
              "language": "auto", "speaker": "vivian" if i % 2 else "ryan", "non_streaming": i % 3 == 0}
    return EngineItem(f"r{i}", "prefill", 0, {"prompt_ids": torch.tensor(ids)}, params)


def run_together(engine, items: list[EngineItem]) -> dict[str, list[torch.Tensor]]:
    """Step the requests together (each joining at its own step) until every one stops; each
    request's frames ``[1, Q]`` in order."""
    frames: dict[str, list[torch.Tensor]] = {item.request_id: [] for item in items}
    pending = list(items)
    running: dict[str, EngineItem] = {}
    step = 0
    while pending or running:
        batch = list(running.values()) + pending[:1 + step % 2]  # requests join on later steps
        pending = pending[1 + step % 2:]
        running = {}
        for item, out in zip(batch, engine.run(batch)):
            if "codes" in out.outputs:
                frames[item.request_id].append(out.outputs["codes"])
            if "stop" in out.flags:
                engine.release(item.request_id)
            else:
                running[item.request_id] = EngineItem(item.request_id, "decode", item.iteration + 1,
                                                      {"token": out.outputs["token"]}, item.params)
        step += 1
    return frames


@pytest.fixture(scope="module")
def eager(tiny) -> dict[str, list[torch.Tensor]]:
    """The eager engine's frames of the 8 requests stepped together."""
    return run_together(make_engine(tiny), [request(tiny, i) for i in range(8)])


def test_concurrent_seeded_requests_equal_their_solo_codes(tiny, eager) -> None:
    items = [request(tiny, i) for i in range(8)]
    together = eager
    for item in items:
        alone = run_together(make_engine(tiny), [item])[item.request_id]
        assert len(alone) >= 2 and len(together[item.request_id]) == len(alone)
        assert torch.equal(torch.cat(together[item.request_id]), torch.cat(alone)), item.request_id
    # seeded sampling varies the codes from request to request (not all greedy-equal)
    firsts = {tuple(frames[0].reshape(-1).tolist()) for frames in together.values()}
    assert len(firsts) > 2


# the fused kernels run on this CPU model only under Triton's interpreter, which the test
# session turns on only where there is no GPU (tests/conftest.py)
FUSED_ON_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors need Triton's interpreter")
FAST = [{"cuda_graphs": True}, {"overlap_scheduling": True}, {"cuda_graphs": True, "overlap_scheduling": True},
        pytest.param({"cuda_graphs": True, "overlap_scheduling": True, "fused_kernels": True}, marks=FUSED_ON_CPU)]


@pytest.mark.parametrize("knobs", FAST, ids=["graphs", "overlap", "graphs+overlap", "graphs+overlap+fused"])
def test_fast_path_equals_eager(tiny, eager, knobs) -> None:
    """Graphs (on the CPU: the same buckets, padding and static buffers, run eagerly), overlap
    scheduling and the fused kernels (on the CPU under Triton's interpreter: float32 sums in
    other orders, the same codes here) give the eager engine's codes for 8 seeded requests
    stepped together (under the interpreter: the first 5 requests' first 4 frames, each
    request's codes being its own whatever the batch)."""
    fused = knobs.get("fused_kernels", False)
    count, frames = (5, 4) if fused else (8, 8)
    items = [request(tiny, i, frames) for i in range(count)]
    engine = make_engine(tiny, graph_batch_sizes=(1, 2, 4, 8), **knobs)
    fast = run_together(engine, items)
    for item in items:
        got, want = fast[item.request_id], eager[item.request_id]
        assert len(got) == min(frames, len(want)), item.request_id
        assert torch.equal(torch.cat(got), torch.cat(want[:len(got)])), item.request_id
    if knobs.get("cuda_graphs"):
        assert engine.engine.graphs is not None and engine.engine.rules.frames.graphs is not None
    layers = [m for m in tiny[1].modules() if isinstance(m, LlamaDecoderLayer)]
    assert len(layers) > 2 and all(m.fused_kernels == knobs.get("fused_kernels", False) for m in layers)
    assert engine.stats()["talker_input_slots_used"] == 0  # every slot freed at release


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: graphs captured and replayed")
def test_cuda_graphs_equal_eager_on_cuda(tiny) -> None:
    """On a GPU the captured talker step and frame graphs give the eager step's codes."""
    ckpt, talker, tokenizer = tiny
    cuda = talker.to("cuda")
    items = [request(tiny, i) for i in range(8)]
    runs = []
    for knobs in ({}, {"cuda_graphs": True, "overlap_scheduling": True}):
        engine = talker_engine(cuda, ckpt.config(), num_pages=64, page_size=16, max_seq_len=256,
                               device=torch.device("cuda"), dtype=torch.float32, attention_backend="triton",
                               graph_batch_sizes=(1, 2, 4, 8), **knobs)
        runs.append(run_together(engine, items))
    talker.to("cpu")
    for item in items:
        assert torch.equal(torch.cat(runs[1][item.request_id]), torch.cat(runs[0][item.request_id]))


def test_knobs_reach_the_talker_engine(tmp_path) -> None:
    root = write_checkpoint(tmp_path / "ckpt")
    base = {"model": "qwen3_tts", "model_path": str(root), "load_format": "dummy", "device": "cpu", "dtype": "float32",
            "max_seq_len": 256, "node_groups": [{"node_names": ["talker", "codec"], "ranks": [0]}]}
    spec = model_class("qwen3_tts")(parse_config(base | {"model_kwargs": {"overlap_scheduling": True}}))
    assert not spec.knobs.cuda_graphs
    talker = spec.build_engines({"talker"}, torch.device("cpu"))["talker"]
    assert talker.engine.overlap and talker.engine.graphs is None
    for knob in ("cuda_graphs", "codec_cuda_graphs"):
        with pytest.raises(ValueError, match=f"model_kwargs.{knob} needs device: cuda"):
            model_class("qwen3_tts")(parse_config(base | {"model_kwargs": {knob: True}}))


def test_codec_window_graphs_equal_eager(tiny) -> None:
    """The codec's windows through ``window_graphs`` (on the CPU: padded to a batch bucket,
    over static inputs, eagerly) equal the eager decode of each window, three streams' ramps
    stepped together (so windows of one shape batch, 3 padded to 4)."""
    ckpt = tiny[0]
    codec = ckpt.codec("cpu", torch.float32, dummy=True, seed=1)
    torch.manual_seed(3)
    codes = torch.randint(0, 64, (3, 4, 30))
    streams = [windows(f"c{i}", codes[i]) for i in range(3)]
    eager, graphs = CodecEngine(codec, left_context=4), CodecEngine(codec, left_context=4, cuda_graphs=True)
    for step in zip(*streams):
        step = list(step)
        want = eager.run(step)
        got = graphs.run(step)
        for a, b in zip(got, want):
            peak = b.outputs["audio"].abs().max()
            assert a.outputs["audio"].shape == b.outputs["audio"].shape
            assert (a.outputs["audio"] - b.outputs["audio"]).abs().max() <= 1e-5 * peak


def test_packed_windows_of_mixed_contexts_equal_each_alone(tiny) -> None:
    """Windows at different points of streams (contexts from none to the whole left context of
    30, 1 to 25 new frames), packed by conv length and padded on the right, a step at a time:
    each equals its own ``decode_window``, and a step makes one call per conv length."""
    codec = tiny[0].codec("cpu", torch.float32, dummy=True, seed=1)
    torch.manual_seed(5)
    codes = torch.randint(0, 64, (codec.config.num_quantizers, 60))
    decode = packed_windows(codec)
    steps = [[(0, 1), (1, 2), (3, 4), (12, 8)], [(1, 3), (4, 8), (20, 12), (30, 25)], [(7, 6), (2, 2), (0, 25), (9, 1)]]
    keys = set()
    for step in steps:  # (first new frame, new frames) a window
        windows = [(codes[:, max(0, start - 30):start + new], min(30, start)) for start, new in step]
        for (window, context), audio in zip(windows, decode(windows)):
            want = codec.decode_window(window[None], context)[0]
            assert audio.shape == want.shape
            assert (audio - want).abs().max() <= 1e-5 * want.abs().max()
        keys |= {conv_frames(w.shape[-1] - c + min(codec.conv_reach, c)) for w, c in windows}
    assert len(decode.graphs.inputs) <= 2 * len(keys)  # a (rows, window length, conv length) each


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the codec's window graphs captured")
def test_codec_window_graphs_equal_eager_on_cuda(tiny) -> None:
    codec = tiny[0].codec("cuda", torch.float32, dummy=True, seed=1)
    # The packed windows are padded to their conv length, so cuDNN may pick other kernels than
    # the eager window's, and the dummy codec's wide weights (drawn to be audible) amplify any
    # rounding: on an H100 (2026-12-07) the paths differed by 1.1e-5 to 1.1e-3 of a window's
    # peak from run to run, TF32 on or off. Halved, the weights make a well-scaled decoder (as
    # in the bf16 test below), whose paths differ by rounding alone.
    with torch.no_grad():
        for p in codec.parameters():
            if p.dim() > 1:
                p.mul_(0.5)
    torch.manual_seed(3)
    codes = torch.randint(0, 64, (3, 4, 30))
    streams = [windows(f"c{i}", codes[i]) for i in range(3)]
    eager, graphs = CodecEngine(codec, left_context=4), CodecEngine(codec, left_context=4, cuda_graphs=True)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    # each stream's audio against its own peak. The halved codec speaks quietly (stream peaks
    # ~4e-3) next to its activations, so float32 rounding shows at ~1e-4 of the output: on an
    # H100 (2026-12-07) a first window (one frame, peak 9e-4) differed by 2.8e-7, 7e-5 of its
    # stream's peak. A graph replaying stale or misplaced rows differs by the audio itself.
    err: dict[tuple[str, int], float] = {}  # (stream, capture or replay) -> the largest difference
    peak: dict[tuple[str, int], float] = {}  # -> the eager audio's peak
    try:
        for step in zip(*streams):
            for replay in range(2):  # captured, then replayed
                for item, a, b in zip(step, graphs.run(list(step)), eager.run(list(step))):
                    key = (item.request_id, replay)
                    diff = (a.outputs["audio"] - b.outputs["audio"]).abs().max()
                    err[key] = max(err.get(key, 0.0), float(diff))
                    peak[key] = max(peak.get(key, 0.0), float(b.outputs["audio"].abs().max()))
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    for key in err:
        assert err[key] <= 1e-3 * peak[key], f"{key}: {err[key] / peak[key]:.2e} of the stream's peak"
        assert peak[key] > 1e-3  # not silence


def windows(request_id: str, codes: torch.Tensor, ramp=(1, 3, 8, 6), left=4) -> list[EngineItem]:
    spans = stream_windows(codes.shape[-1], ramp, left)
    return [EngineItem(request_id, "decode", i, {"codes": codes[:, start - ctx:start + new].T.contiguous()}, {},
                       chunk=ChunkRef("codes", "codes", [], i, ctx, ctx + new, last=i == len(spans) - 1))
            for i, (start, ctx, new) in enumerate(spans)]


def test_bfloat16_codec_tracks_float32(tiny, tmp_path) -> None:
    """``codec_dtype: bfloat16`` reaches the codec engine, and a bf16 window's audio follows the
    float32 window's to bf16's rounding. The dummy codec's wide weights (drawn to be audible)
    amplify any rounding into other audio, so both take them halved: a well-scaled decoder."""
    root = write_checkpoint(tmp_path / "ckpt")
    base = {"model": "qwen3_tts", "model_path": str(root), "load_format": "dummy", "device": "cpu", "dtype": "float32",
            "max_seq_len": 256, "node_groups": [{"node_names": ["talker", "codec"], "ranks": [0]}]}
    spec = model_class("qwen3_tts")(parse_config(base | {"model_kwargs": {"codec_dtype": "bfloat16"}}))
    engine = spec.build_engines({"codec"}, torch.device("cpu"))["codec"]
    assert {p.dtype for p in engine.codec.parameters()} == {torch.bfloat16}
    full = tiny[0].codec("cpu", torch.float32, dummy=True, seed=1)
    with torch.no_grad():
        for p in full.parameters():
            if p.dim() > 1:
                p.mul_(0.5)
    half = tiny[0].codec("cpu", torch.bfloat16, dummy=True, seed=1)
    half.load_state_dict({k: v.to(torch.bfloat16) for k, v in full.state_dict().items()})
    torch.manual_seed(3)
    codes = torch.randint(0, 64, (2, full.config.num_quantizers, 20))
    with torch.no_grad():
        want, got = full.decode_window(codes, 4), half.decode_window(codes, 4).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()  # measured 7.5e-3

