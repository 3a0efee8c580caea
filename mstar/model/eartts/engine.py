"""The talker's per-frame step over many sessions: one text token in, one frame of RVQ codes
and that frame's PCM out, in the same step.

Each session owns two streams on the paged KV pool (its conditional and unconditional CFG
contexts, sequences ``<id>:c`` and ``<id>:u``), one slot of the codec-state pool (its causal
decoder's state, ``CodecDecoder.state_shapes``), its previous frame's codes and a
``torch.Generator`` seeded by the request: a frame's sampling noise is drawn from it before
the step, so a session's speech does not depend on which sessions share its steps.

A session's first step prefills its speaker/text warm-up (``Warmup``: the prompt codes, the
speaker latent and the warm-up text) together with its first token, as one chunk per stream;
the other sessions of that step decode one token per stream, all in one packed batch. Codes
at or past ``codebook_size`` (the warm-up's pad code) are decoded as the silence frame.

With ``cuda_graphs`` a step's steady sessions (past their warm-up, on the engine's default
sampling) run as one replay of a CUDA graph per batch bucket (``frame_graphs.py``), captured
at start-up (``capture_all``) for buckets up to ``max_sessions``; the sessions warming up, or
sampling with other knobs, step eagerly beside them in the same call, as before.

The API the duplex graph drives (``nemotron_duplex``'s ``eartts_talker`` node):
``open(session, warmup, seed)``, ``step({session: text_token})`` -> ``{session: Frame}``,
``close(session)`` -> the decoder's last samples, with ``pages_used`` / ``slots_used`` for
the pools' accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.engine.page_pool import OutOfPages, PagePool
from mstar.engine.state_pool import StatePool
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache, to_device
from mstar.model.eartts.checkpoint import EarTTS
from mstar.model.eartts.codec import CodecState
from mstar.model.eartts.frame_graphs import SteadyFrames, buckets_up_to
from mstar.model.eartts.talker import FrameNoise


@dataclass
class Warmup:
    """One session's warm-up: ``codes [T, Q]`` (the text prompt's silence and the speaker
    prompt, pad code at the first audio position), ``audio_mask [T]`` (True from the first
    audio position), ``text_ids``/``text_mask [T]`` and the speaker latent ``[T, H]`` (None:
    the frozen projection of the prompt codes). Its last code row is the first step's
    previous frame."""

    codes: torch.Tensor
    audio_mask: torch.Tensor
    text_ids: torch.Tensor
    text_mask: torch.Tensor
    speaker: torch.Tensor | None = None

    @classmethod
    def for_speaker(cls, speaker: torch.Tensor, silence: torch.Tensor, *, prompt_frames: int, text_pad_id: int,
                    text_eos_id: int, codebook_size: int) -> Warmup:
        """The reference's warm-up for a cached speaker (``DuplexEARTTS.set_init_inputs`` with a
        ``speaker_name``, no system prompt): text ``[eos, pad, ..., pad, eos]`` over one text
        frame and ``prompt_frames`` prompt frames (3 s: 37), shifted left by one, its last
        three unmasked; the codes are the codec's encoding of silence (every frame the
        ``silence`` frame), the pad code at the first position and at the first audio
        position (the last two are audio); the final position is dropped, its code (the pad)
        being the first step's previous frame. ``speaker``: the cached latent ``[T, H]``."""
        total = 1 + prompt_frames
        text = torch.full((total,), text_pad_id, dtype=torch.long)
        text[0] = text[-1] = text_eos_id
        ids = torch.cat([text[1:], torch.zeros(1, dtype=torch.long)])
        audio_mask = torch.zeros(total, dtype=torch.bool)
        audio_mask[-2:] = True
        text_mask = torch.zeros(total, dtype=torch.bool)
        text_mask[-3:] = True
        codes = silence.long()[None].repeat(total, 1)
        codes[0] = codes[total - 2] = codebook_size
        if speaker.dim() == 3:
            speaker = speaker[0]
        return cls(codes[:-1], audio_mask[:-1], ids[:-1], text_mask[:-1], speaker[: total - 1])


@dataclass
class Sampling:
    guidance: float = 0.5
    top_p: float | int = 0.8
    noise_scale: float = 0.8


@dataclass
class Frame:
    codes: torch.Tensor  # [Q]
    pcm: torch.Tensor  # this frame's final samples (the first frame's start without the padding)


@dataclass
class _Session:
    warmup: Warmup | None
    generator: torch.Generator
    sampling: Sampling
    prev: torch.Tensor
    length: int = 0  # positions per stream in the KV pool
    slot: int = -1


class TalkerEngine:
    def __init__(self, model: EarTTS, *, max_sessions: int, num_pages: int, page_size: int = 16,
                 text_eos_id: int | None = None, kv_head_dim: int | None = None, max_positions: int | None = None,
                 attention_backend: str = "torch", cuda_graphs: bool = False) -> None:
        """``kv_head_dim``: the KV pool's head dim when a kernel needs a wider one than the
        talker's 72 (q/k/v are zero-padded to it, which is exact). ``max_positions``: the most
        positions a session's stream may hold (its warm-up and its frames; a step past it is
        refused): a sliding window at least that wide is left out on the ``"triton"`` backend
        (which has none), and it sizes the graphs' page tables. ``cuda_graphs``: steady
        frames from CUDA graphs (module docstring); on CUDA it needs ``"triton"``."""
        self.model = model
        self.config = model.config.talker
        param = model.talker.bos_emb
        self.device, self.dtype = param.device, param.dtype
        talker = self.config
        self.max_positions, self.backend = max_positions, attention_backend
        windows = {w for w in map(talker.window, range(talker.num_hidden_layers)) if w is not None}
        if attention_backend != "torch" and windows and (max_positions is None or min(windows) < max_positions):
            raise ValueError(f"the {attention_backend!r} attention backend has no sliding window: the talker's "
                             f"({min(windows)}) must be at least max_positions ({max_positions})")
        if cuda_graphs and max_positions is None:
            raise ValueError("cuda_graphs needs max_positions (the graphs' page tables)")
        if cuda_graphs and self.device.type == "cuda" and attention_backend == "torch":
            raise ValueError("the 'torch' attention backend synchronises with the host and cannot be captured "
                             "in a CUDA graph; use 'triton'")
        self.pages = PagePool(num_pages, page_size)
        # the last page is scratch: padded graph rows write their K/V there
        self.kv = allocate_kv_cache(talker.num_hidden_layers, num_pages + 1, page_size, talker.num_key_value_heads,
                                    max(talker.head_dim, kv_head_dim or 0), self.dtype, self.device)
        self.slots = StatePool(max_sessions + 1)  # StatePool keeps one slot back (the sink: padded graph rows)
        self.codec_state = [torch.zeros(max_sessions + 1, *shape, device=self.device,
                                        dtype=torch.float32 if len(shape) == 1 else self.dtype)
                            for shape in model.codec.state_shapes()]
        self.text_eos_id = text_eos_id
        self.sampling = Sampling(talker.guidance_scale, talker.top_p, talker.noise_scale)
        self.sessions: dict[str, _Session] = {}
        self.steady: SteadyFrames | None = None
        if cuda_graphs:
            # each slot's previous codes, which a graphed frame reads and writes
            self.prev_codes = torch.zeros(max_sessions + 1, talker.num_quantizers, dtype=torch.long,
                                          device=self.device)
            self.steady = SteadyFrames(
                model, self.kv, self.codec_state, self.prev_codes, guidance=self.sampling.guidance,
                top_p=self.sampling.top_p, noise_scale=self.sampling.noise_scale, sink=self.slots.sink,
                page_size=page_size, max_pages=-(-max_positions // page_size), scratch_page=num_pages,
                longest=max_positions, backend=attention_backend, batch_sizes=buckets_up_to(max_sessions))

    def capture_all(self) -> None:
        """Capture the steady frames' graphs of every bucket now (start-up; nothing to do off
        CUDA or without ``cuda_graphs``)."""
        if self.steady is not None:
            self.steady.capture_all()

    # -- sessions --------------------------------------------------------------------------
    def open(self, session: str, warmup: Warmup, seed: int, sampling: Sampling | None = None) -> None:
        if session in self.sessions:
            raise ValueError(f"session {session!r} is already open")
        generator = torch.Generator(device=self.device).manual_seed(seed)
        slot = self.slots.allocate(session)
        for tensor in self.codec_state:
            tensor[slot].zero_()
        sampling = sampling or self.sampling
        self.sessions[session] = _Session(warmup, generator, sampling, warmup.codes[-1].clone(),
                                          slot=slot)

    def close(self, session: str) -> torch.Tensor:
        """Free the session's pages and codec slot; its decoder's last samples."""
        state = self.sessions.pop(session)
        if state.warmup is not None:  # never stepped: no audio
            tail = torch.zeros(0, device=self.device)
        else:
            tail = self.model.codec.flush(self._codec_rows([state.slot]))[0]
        self.slots.free(session)
        for stream in self._streams(session):
            if self.pages.has(stream):
                self.pages.free(stream)
        return tail

    @property
    def pages_used(self) -> int:
        return self.pages.num_used_pages

    @property
    def slots_used(self) -> int:
        return self.slots.num_used

    # -- the step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: dict[str, int], noise: dict[str, FrameNoise] | None = None) -> dict[str, Frame]:
        """Advance each session of ``tokens`` by one frame (sessions in order of the dict).
        ``noise``: a session's sampling noise given instead of drawn (a parity test's)."""
        if not tokens:
            return {}
        order = list(tokens)
        sessions = [self.sessions[s] for s in order]
        given = noise or {}
        counts = [1 if s.warmup is None else s.warmup.codes.shape[0] + 1 for s in sessions]
        starts = self._reserve(order, sessions, counts)  # refused (OutOfPages) before anything moves
        graphed = [b for b, (sid, s) in enumerate(zip(order, sessions, strict=True))
                   if s.warmup is None and s.sampling == self.sampling and sid not in given]
        if graphed and (self.steady is None or not self.steady.fits(
                len(graphed), self.pages.pages_needed(max(starts[b] for b in graphed) + 1))):
            graphed = []
        eager = sorted(set(range(len(order))) - set(graphed))
        codes: list[torch.Tensor] = [None] * len(order)  # type: ignore[list-item]
        pcm: list[torch.Tensor] = [None] * len(order)  # type: ignore[list-item]
        for part, run in ((eager, self._eager), (graphed, self._steady)):
            if part:
                frame_codes, frame_pcm = run([order[b] for b in part], [sessions[b] for b in part],
                                             [tokens[order[b]] for b in part], [starts[b] for b in part], given)
                for i, b in enumerate(part):
                    codes[b], pcm[b] = frame_codes[i], frame_pcm[i]
        # The codec's padding leads a session's first frame: known here, not read from the codec.
        leads = [self.model.codec.config.overlap // 2 if state.warmup is not None else 0 for state in sessions]
        frames = {}
        for b, (sid, state) in enumerate(zip(order, sessions, strict=True)):
            state.prev, state.warmup = codes[b], None
            frames[sid] = Frame(codes[b], pcm[b][leads[b]:])
        return frames

    def _eager(self, order: list[str], sessions: list[_Session], tokens: list[int], starts: list[int],
               given: dict[str, FrameNoise]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sessions' frames as one eager pass: (codes ``[B, Q]``, PCM ``[B, samples]``)."""
        ids = to_device(torch.tensor(tokens), self.device)
        texts = self.model.talker.text(ids)  # [B, H]
        embeds, counts = [], []
        for b, (state, token) in enumerate(zip(sessions, tokens, strict=True)):
            audio, text = self._inputs(state, token, texts[b:b + 1])
            for uncond in (False, True):  # the CFG pair: same audio, the second with null text
                flags = torch.full((audio.shape[0],), uncond, dtype=torch.bool, device=self.device)
                embeds.append(self.model.talker.fuse(audio, text, flags))
                counts.append(audio.shape[0])
        meta = self._metadata(order, starts, counts)
        noise = FrameNoise.stack([given[sid] if sid in given else FrameNoise.draw(self.config, s.generator, self.device)
                                  for sid, s in zip(order, sessions, strict=True)])
        longest = self.max_positions if self.backend != "torch" else None  # the torch reference keeps its window
        hidden = self.model.talker.hidden(torch.cat(embeds), meta, self.kv, longest)
        last = to_device(torch.tensor(meta.query_starts[1:]) - 1, self.device)
        pairs = hidden.index_select(0, last).view(len(order), 2, -1)
        codes = self._sample(sessions, pairs, noise)
        pcm, _ = self._decode(sessions, codes)
        if self.steady is not None:  # a graphed frame reads them next
            index = to_device(torch.tensor([s.slot for s in sessions]), self.device)
            self.prev_codes.index_copy_(0, index, codes)
        return codes, pcm

    def _steady(self, order: list[str], sessions: list[_Session], tokens: list[int], starts: list[int],
                given: dict[str, FrameNoise]) -> tuple[torch.Tensor, torch.Tensor]:
        """Steady sessions' frames as one graph replay (``SteadyFrames``)."""
        eos = self.text_eos_id
        rows, tables = [], []
        for sid, state, token, start in zip(order, sessions, tokens, starts, strict=True):
            cond, uncond = self._streams(sid)
            rows.append([token, state.slot, int(token == eos), start,
                         self.pages.slot(cond, start), self.pages.slot(uncond, start)])
            tables += [self.pages.page_table(cond), self.pages.page_table(uncond)]
        uniform, gauss = self.steady.noise([s.generator for s in sessions])
        return self.steady.run(rows, tables, uniform, gauss)

    def _inputs(self, state: _Session, token: int, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A session's audio and text embeddings for this step (its warm-up first, on its
        first step); ``text`` is its token's ``[1, H]``."""
        talker, dev = self.model.talker, self.device
        prev = state.prev
        if self.text_eos_id is not None and token == self.text_eos_id:
            prev = self.model.silence_codes  # the reference forces a silent frame before EOS
        audio = talker.code_embeds(prev[None].to(dev))
        if state.warmup is not None:
            w = state.warmup
            audio = torch.cat([talker.warmup_code_embeds(w.codes.to(dev), w.audio_mask.to(dev),
                                                         None if w.speaker is None else w.speaker.to(dev)), audio])
            text = torch.cat([talker.text(w.text_ids.to(dev), w.text_mask.to(dev)), text])
        return audio.to(self.dtype), text.to(self.dtype)

    def _reserve(self, order: list[str], sessions: list[_Session], counts: list[int]) -> list[int]:
        """Grow each session's two streams by its count, or refuse the whole step before any
        grows; each session's first new position."""
        if self.max_positions is not None:
            over = [sid for sid, s, n in zip(order, sessions, counts, strict=True) if s.length + n > self.max_positions]
            if over:
                raise OutOfPages(f"talker KV: sessions {over} would pass max_positions ({self.max_positions})")
        missing = sum(self.pages.pages_missing(stream, state.length + counts[i])
                      for i, (sid, state) in enumerate(zip(order, sessions, strict=True))
                      for stream in self._streams(sid))
        if missing > self.pages.num_free_pages:  # refused before any session's streams grow
            raise OutOfPages(f"talker KV: the step needs {missing} more pages, {self.pages.num_free_pages} free")
        starts = []
        for sid, state, new in zip(order, sessions, counts, strict=True):
            for stream in self._streams(sid):
                self.pages.reserve(stream, state.length + new)
            starts.append(state.length)
            state.length += new
        return starts

    def _metadata(self, order: list[str], starts: list[int], counts: list[int]) -> PagedAttentionMetadata:
        """An eager pass's metadata: each session's two streams (``counts`` a stream) packed."""
        positions, slots, tables, lens = [], [], [], []
        for i, (sid, start) in enumerate(zip(order, starts, strict=True)):
            new = counts[2 * i]
            for stream in self._streams(sid):
                positions.extend(range(start, start + new))
                slots.extend(self.pages.slots(stream, start, start + new))
                tables.append(self.pages.page_table(stream))
                lens.append(start + new)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)

        def up(tensor: torch.Tensor) -> torch.Tensor:
            return to_device(tensor, self.device)

        return PagedAttentionMetadata(
            positions=up(torch.tensor(positions)), slot_mapping=up(torch.tensor(slots)),
            query_start_loc=up(torch.tensor(starts)), seq_lens=up(torch.tensor(lens)),
            page_table=up(table), page_size=self.pages.page_size, backend=self.backend,
            host_query_start_loc=tuple(starts), host_seq_lens=tuple(lens))

    def _sample(self, sessions: list[_Session], pairs: torch.Tensor, noise: FrameNoise) -> torch.Tensor:
        groups: dict[tuple, list[int]] = {}
        for b, state in enumerate(sessions):
            s = state.sampling
            groups.setdefault((s.guidance, s.top_p, s.noise_scale), []).append(b)
        codes = torch.empty(len(sessions), self.config.num_quantizers, dtype=torch.long, device=self.device)
        for (guidance, top_p, noise_scale), rows in groups.items():
            index = to_device(torch.tensor(rows), self.device)
            chosen = FrameNoise(noise.gumbel[:, index], noise.gauss[:, index])
            codes[index] = self.model.talker.sample_codes(
                pairs[index, 0], pairs[index, 1], chosen, guidance=guidance, top_p=top_p, noise_scale=noise_scale)
        return codes

    def _decode(self, sessions: list[_Session], codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        silence = self.model.silence_codes.to(codes.device)
        codes = torch.where(codes >= self.config.codebook_size, silence[None], codes)
        rows = [s.slot for s in sessions]
        state = self._codec_rows(rows)
        pcm, lead, state = self.model.codec.step(codes[:, None], state)
        index = to_device(torch.tensor(rows), self.device)
        for pool, tensor in zip(self.codec_state, state.tensors(), strict=True):
            pool.index_copy_(0, index, tensor.to(pool.dtype))
        return pcm, lead

    def _codec_rows(self, rows: list[int]) -> CodecState:
        index = to_device(torch.tensor(rows), self.device)
        return CodecState.from_tensors([pool.index_select(0, index) for pool in self.codec_state])

    @staticmethod
    def kv_pages_per_session(max_frames: int, warmup: int, page_size: int) -> int:
        """KV pages a session holds at most: two streams of ``warmup + max_frames``
        positions (the released sizes: 37 + 2000 frames of 160 s in pages of 128 -> 32)."""
        return 2 * -(-(warmup + max_frames) // page_size)

    @staticmethod
    def _streams(session: str) -> tuple[str, str]:
        return f"{session}:c", f"{session}:u"
