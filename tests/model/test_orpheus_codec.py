"""Orpheus's codec node: batched windows (and their CUDA-graph replays) against SNAC's
decode of each chunk on its own, as ``codes_from_orpheus`` lays the codes out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mstar.engine.base import EngineItem
from mstar.model.orpheus.checkpoint import dummy_snac
from mstar.model.orpheus.engine import (
    CODEBOOK,
    SAMPLES_PER_FRAME,
    TOKENS_PER_FRAME,
    SnacGraphs,
    decode_frames,
    snac_fn,
)
from mstar.model.snac import codes_from_orpheus

SMALL = {"encoder_dim": 8, "decoder_dim": 32, "codebook_size": CODEBOOK}


def chunk_item(codes: torch.Tensor, keep_start: int, keep_end: int) -> EngineItem:
    chunk = SimpleNamespace(keep_start=keep_start, keep_end=keep_end)
    return EngineItem("r", "decode", 0, {"codes": codes}, {}, chunk)


def alone(decoder, codes: torch.Tensor, keep_start: int, keep_end: int) -> torch.Tensor:
    """One chunk as the reference layout decodes it: its whole frames, the kept samples."""
    frames = codes.numel() // TOKENS_PER_FRAME
    if frames == 0:
        return torch.zeros(0)
    with torch.inference_mode():
        audio = decoder.decode(codes_from_orpheus(codes[: frames * TOKENS_PER_FRAME].tolist()), noise=False)[0, 0]
    return audio[keep_start // TOKENS_PER_FRAME * SAMPLES_PER_FRAME:
                 min(keep_end // TOKENS_PER_FRAME, frames) * SAMPLES_PER_FRAME]


@pytest.fixture(scope="module")
def decoder():
    return dummy_snac(SMALL, torch.device("cpu"), seed=3)


def test_dummy_codec_has_weight_norm_folded(decoder) -> None:
    """A dummy deployment runs the codec a checkpoint gives (weight norm folded at load)."""
    assert not any("parametrizations" in name for name, _ in decoder.named_parameters())


def test_decode_frames_is_the_reference_layout(decoder) -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, CODEBOOK, (3, 4 * TOKENS_PER_FRAME), generator=g)
    levels = [torch.tensor(c) for c in ((0,), (1, 4), (2, 3, 5, 6))]
    with torch.inference_mode():
        batch = decode_frames(decoder, codes, levels)
        rows = [decoder.decode(codes_from_orpheus(row.tolist()), noise=False)[0, 0] for row in codes]
    torch.testing.assert_close(batch, torch.stack(rows), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "buckets"])
def test_a_plan_of_mixed_chunks_equals_each_alone(decoder, graphs: bool) -> None:
    """Full windows (some in a padded bucket), a first chunk keeping two frames, a stream's
    short last chunk and a partial frame: each item's audio is what its chunk gives alone."""
    g = torch.Generator().manual_seed(1)
    window = 4 * TOKENS_PER_FRAME

    def codes(n: int) -> torch.Tensor:
        return torch.randint(0, CODEBOOK, (n,), generator=g)

    items = [chunk_item(codes(window), 0, 14), chunk_item(codes(window), 7, 14), chunk_item(codes(window), 7, 14),
             chunk_item(codes(17), 7, 17), chunk_item(codes(window + 5), 7, window + 5),
             chunk_item(codes(3), 0, 3)]
    codec = SnacGraphs(decoder, 4, [1, 2, 4]) if graphs else None
    with torch.inference_mode():
        out = snac_fn(decoder, codec)("decode", items)
    for item, result in zip(items, out):
        c = item.inputs["codes"]
        torch.testing.assert_close(result["audio"], alone(decoder, c, item.chunk.keep_start, item.chunk.keep_end),
                                   rtol=1e-5, atol=1e-6)
    assert out[-1]["audio"].numel() == 0
    if graphs:
        assert codec.graphs.captured_batch_sizes == (4,)  # three full windows padded to a bucket of 4


def test_codes_out_of_range_are_refused(decoder) -> None:
    item = chunk_item(torch.full((4 * TOKENS_PER_FRAME,), CODEBOOK), 0, 14)
    with pytest.raises(ValueError, match="must lie in"):
        snac_fn(decoder)("decode", [item])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replays_on_the_codec_stream_equal_eager_on_cuda() -> None:
    """On the GPU: the captured windows, replayed on the codec's own stream while other work
    is queued on the default one, equal the eager decode."""
    device = torch.device("cuda")
    decoder = dummy_snac({}, device, seed=3)  # the real 24 kHz shapes
    codec = SnacGraphs(decoder, 4, [1, 2, 4, 8])
    codec.capture_all()
    g = torch.Generator().manual_seed(2)
    items = [chunk_item(torch.randint(0, CODEBOOK, (28,), generator=g), 7, 14) for _ in range(5)]
    busy = torch.randn(4096, 4096, device=device)
    with torch.inference_mode():
        for _ in range(8):
            busy = busy @ busy.T / 64  # a queue of work on the default stream
        replayed = snac_fn(decoder, codec)("decode", items)
        eager = snac_fn(decoder)("decode", items)
    for a, b in zip(replayed, eager):
        torch.testing.assert_close(a["audio"], b["audio"], rtol=1e-4, atol=1e-5)
