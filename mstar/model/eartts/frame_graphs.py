"""The talker's steady frame step, one CUDA-graph replay per batch bucket of sessions.

A session past its warm-up frame steps the same way every frame: one position on each of its
two CFG streams, its text token and previous codes fused, the backbone over the pair, the MoG
head's unmasking iterations, the codec's frame from its state slot. Eagerly that is a few
thousand small kernels (28 layers over the pair, 8 head iterations of 3 MLP layers and the
residual quantizer, the codec's ConvNeXt blocks), launch-bound at any batch; here the whole
frame of ``B`` sessions replays from one graph (``BucketGraphs``) over static inputs.

Per session row (``B`` rows padded to the bucket):

* ``text``: its token; ``eos``: 1 when the token is the text EOS, which makes the previous
  codes the silence frame (the reference's ``inference_force_speech_silence_on_eos``),
  chosen in the graph by a ``where``, so nothing is read back;
* ``slot``: its codec-state slot, which also indexes its previous codes in ``prev_codes``
  (written by the graph with the frame's codes, by the engine after an eager frame);
* ``position``, ``kv_slot`` (its two streams' cache slots) and ``page_table`` (their two
  tables): decode-only paged metadata of the pair, built on the host and uploaded at once;
* ``uniform``/``gauss``: the frame's draws from the session's own generator, made outside the
  graph (``torch.rand``/``randn`` into a staging tensor, so a seeded call speaks the same
  whoever shares its steps); the Gumbel transform runs in the graph, elementwise.

Padded rows are token 0 at position 0 with zero draws, their K/V written to and read from a
scratch page no stream owns, their codec state and previous codes in the state pool's sink
slot. The output is one float32 ``[B, Q + samples]``: the codes (exact, below ``2**24``) and
the frame's PCM. Off CUDA the same buckets and padding run eagerly (``GraphRunner``).

The graph records no host read (``tests/model/eartts/test_eartts_frame_graphs.py`` pins it):
the attention must be a backend that does not synchronise (``"triton"``: decode-only, shapes
from the static page table's width), which has no sliding window; a window at least as wide
as a stream can grow (``longest``) never binds, and is left out (the released 4096 against a
160 s call's 2039 positions).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mstar.engine import cuda_graphs
from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES, BucketGraphs
from mstar.layers.paged_kv import PagedAttentionMetadata, to_device
from mstar.model.eartts.checkpoint import EarTTS
from mstar.model.eartts.codec import CodecState
from mstar.model.eartts.talker import FrameNoise, gumbel, noise_shape

_HEAD = ("text", "slot", "eos", "position", "kv_slot_c", "kv_slot_u")  # a row's leading ints


def buckets_up_to(sessions: int, sizes: Iterable[int] = DEFAULT_BATCH_SIZES) -> tuple[int, ...]:
    """The batch buckets a deployment of ``sessions`` concurrent sessions captures: the
    engine's ``buckets_up_to`` of the smallest of ``sizes`` that holds it (``sessions`` itself
    past the largest)."""
    return cuda_graphs.buckets_up_to(next((s for s in sorted(sizes) if s >= sessions), sessions), sizes)


class SteadyFrames:
    """Steady frames of up to ``max(batch_sizes)`` sessions replayed per bucket. The graph
    writes ``kv`` (the pair's two slots), ``codec_state`` and ``prev_codes`` (the rows of each
    session's ``slot``); ``sink`` is the state pools' slot no session owns, ``scratch_page``
    the KV page none does, ``max_pages`` the static page table's width per stream."""

    def __init__(self, model: EarTTS, kv: list[torch.Tensor], codec_state: list[torch.Tensor],
                 prev_codes: torch.Tensor, *, guidance: float, top_p: float | int, noise_scale: float, sink: int,
                 page_size: int, max_pages: int, scratch_page: int, longest: int, backend: str,
                 batch_sizes: Iterable[int]) -> None:
        self.model, self.kv, self.codec_state, self.prev_codes = model, kv, codec_state, prev_codes
        self.sampling = {"guidance": guidance, "top_p": top_p, "noise_scale": noise_scale}
        self.page_size, self.max_pages, self.longest, self.backend = page_size, max_pages, longest, backend
        config = model.config.talker
        self.quantizers, self.codebook_size = config.num_quantizers, config.codebook_size
        device, self.dtype = prev_codes.device, model.talker.bos_emb.dtype
        self.device = device
        self.silence = model.silence_codes.to(device)
        n = max(batch_sizes)
        active, components, latent = noise_shape(config)

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros((n, *shape), dtype=torch.int64, device=device)

        buffers = {"text": ints(), "slot": ints(), "eos": ints(), "position": ints(), "kv_slot": ints(2),
                   "page_table": ints(2, max_pages),
                   "uniform": torch.zeros(n, active, components, device=device),
                   "gauss": torch.zeros(n, active, latent, device=device)}
        table_pad = torch.zeros(2, max_pages, dtype=torch.int64, device=device)
        table_pad[:, 0] = scratch_page
        pads = {"text": 0, "slot": sink, "eos": 0, "position": 0, "kv_slot": scratch_page * page_size,
                "page_table": table_pad, "uniform": 0.0, "gauss": 0.0}
        self.query_start_loc = torch.arange(2 * n + 1, dtype=torch.int64, device=device)  # a token a stream
        self.uncond = torch.arange(2 * n, device=device) % 2 == 1  # each pair: conditional, then null text
        self.graphs = BucketGraphs(self._frame, buffers, pads, batch_sizes)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self.graphs.batch_sizes

    def fits(self, batch: int, pages: int) -> bool:
        """A steady step of ``batch`` sessions whose streams hold at most ``pages`` pages."""
        return self.graphs.fits(batch) and pages <= self.max_pages

    def capture_all(self) -> None:
        self.graphs.capture_all()

    def noise(self, generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each session's draws, in ``FrameNoise.draw``'s order from its own generator:
        uniforms ``[B, I, n]`` and normals ``[B, I, D]`` (two launches a session)."""
        uniform, gauss = self.graphs.buffers["uniform"], self.graphs.buffers["gauss"]
        batch = len(generators)
        u = torch.empty(batch, *uniform.shape[1:], device=self.device)
        g = torch.empty(batch, *gauss.shape[1:], device=self.device)
        for b, generator in enumerate(generators):
            torch.rand(u.shape[1:], generator=generator, out=u[b])
            torch.randn(g.shape[1:], generator=generator, out=g[b])
        return u, g

    def run(self, rows: list[list[int]], tables: list[list[int]], uniform: torch.Tensor, gauss: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The frames of ``B`` sessions: ``rows[b]`` its ints (``_HEAD``'s order), ``tables``
        its two streams' page tables (``2 B`` lists), ``uniform``/``gauss`` its draws. Returns
        the codes ``[B, Q]`` and the PCM ``[B, samples]``."""
        batch, width = len(rows), max(len(t) for t in tables)
        host = torch.tensor([row + c + [0] * (width - len(c)) + u + [0] * (width - len(u))
                             for row, c, u in zip(rows, tables[0::2], tables[1::2], strict=True)], dtype=torch.int64)
        ints = to_device(host, self.device)  # one upload a step
        head = len(_HEAD)
        inputs = {"text": ints[:, 0], "slot": ints[:, 1], "eos": ints[:, 2], "position": ints[:, 3],
                  "kv_slot": ints[:, 4:head], "page_table": ints[:, head:].view(batch, 2, width),
                  "uniform": uniform, "gauss": gauss}
        out = self.graphs.run(batch, inputs)
        return out[:, :self.quantizers].long(), out[:, self.quantizers:]

    def _frame(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """What a bucket's graph records: the engine's eager frame, over the bucket's rows."""
        talker, batch = self.model.talker, rows["text"].shape[0]
        slots = rows["slot"]
        prev = torch.where(rows["eos"][:, None] != 0, self.silence, self.prev_codes.index_select(0, slots))
        audio = talker.code_embeds(prev).to(self.dtype)
        text = talker.text(rows["text"]).to(self.dtype)
        pair = (batch, 2, audio.shape[-1])
        embeds = talker.fuse(audio[:, None].expand(pair).reshape(2 * batch, -1),
                             text[:, None].expand(pair).reshape(2 * batch, -1), self.uncond[:2 * batch])
        # contiguous: at one row the flattened expand is a stride-0 view, which the Triton
        # kernels (reading by element) would take for the padding after it
        positions = rows["position"][:, None].expand(batch, 2).contiguous().view(-1)
        meta = PagedAttentionMetadata(
            positions=positions, slot_mapping=rows["kv_slot"].reshape(-1),
            query_start_loc=self.query_start_loc[:2 * batch + 1], seq_lens=positions + 1,
            page_table=rows["page_table"].reshape(2 * batch, -1), page_size=self.page_size, backend=self.backend)
        hidden = talker.hidden(embeds, meta, self.kv, self.longest).view(batch, 2, -1)
        noise = FrameNoise(gumbel(rows["uniform"]).transpose(0, 1), rows["gauss"].transpose(0, 1))
        codes = talker.sample_codes(hidden[:, 0], hidden[:, 1], noise, **self.sampling)
        self.prev_codes.index_copy_(0, slots, codes)
        spoken = torch.where(codes >= self.codebook_size, self.silence, codes)  # as the eager decode
        state = CodecState.from_tensors([pool.index_select(0, slots) for pool in self.codec_state])
        pcm, _, state = self.model.codec.step(spoken[:, None], state)
        for pool, tensor in zip(self.codec_state, state.tensors(), strict=True):
            pool.index_copy_(0, slots, tensor.to(pool.dtype))
        return torch.cat((codes.float(), pcm.float()), dim=1)
