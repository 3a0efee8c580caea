"""Pi0.5's engine: one node, ``policy``, holding the paged KV cache its two phases share.

Ops (ports in brackets):

- ``prefill`` [pixels, prompt_ids -> prefix]: reserve the request's pages (prefix plus one
  action chunk), encode every camera image of every request in the batch in one SigLIP
  forward, and run all their prefixes through the language model in one forward. ``prefix``
  is the prefix length, a marker the denoise steps read. With ``cuda_graphs`` a prefill of
  requests bringing the same number of images replays from graphs of the batch buckets' sizes
  (``_prefill_graphed``): 15 requests as 8 + 4 + 2 + 1, so every count reuses a few graphs.
- ``step`` [actions, prefix -> actions]: one Euler step of the flow from time 1 to 0, for every
  request in the batch in one expert forward (each at its own iteration and step count). Its
  attention takes the step as ``ChunkKeys``: every request's keys gathered to one padded length
  and attended to at once. With ``cuda_graphs`` the whole step (time embedding, expert, Euler
  update) replays from a CUDA graph per (batch bucket, key-length bucket): a step of a small
  expert is hundreds of launches whose host time exceeds their GPU time. Padded rows write to a
  scratch page no request owns. A key-length bucket's first step captures every batch bucket
  at once: how many requests a step holds depends on when they arrived.
- ``finish`` [actions -> action]: the chunk cut to the embodiment's action width and
  unnormalised with its statistics, float32 on the host; the pages are freed.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

import torch

from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES, ShapeGraphs
from mstar.engine.page_pool import PagePool
from mstar.layers.paged_kv import allocate_kv_cache, to_device
from mstar.model.pi05.checkpoint import Embodiment
from mstar.model.pi05.gemma import ChunkKeys
from mstar.model.pi05.modeling import Pi05Policy

PREFILL, STEP, FINISH = "prefill", "step", "finish"
KEY_BUCKET = 64  # a graphed step's key length is rounded up to a multiple of this
PROMPT_BUCKET = 16  # a graphed prefill's prompt length is rounded up to a multiple of this


class Pi05Engine(Engine):
    def __init__(self, model: Pi05Policy, embodiments: Callable[[str], Embodiment], device: torch.device,
                 dtype: torch.dtype, num_pages: int, page_size: int, cuda_graphs: bool = False,
                 batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, max_graphs: int = 32):
        self.model = model
        self.embodiments = embodiments
        self.device = device
        self.dtype = dtype
        self.pool = PagePool(num_pages, page_size)
        self.scratch = num_pages  # the page padded rows of a graphed step write to (cuda_graphs)
        dims = model.config.text
        self.caches = allocate_kv_cache(dims.num_layers, num_pages + int(cuda_graphs), page_size, dims.num_kv_heads,
                                        dims.head_dim, dtype, device)
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.graphs = ShapeGraphs(self._denoise, device, max_graphs) if cuda_graphs else None
        self.prefill_graphs = ShapeGraphs(self._prefill_rows, device, max_graphs) if cuda_graphs else None
        self.step_lengths: set[int] = set()  # the key lengths whose step graphs were captured
        self.prefix_lens: dict[str, int] = {}
        self.forward_rows: list[int] = []  # requests of each recent denoise forward (batch log)

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        by_op: dict[str, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            if item.op not in (PREFILL, STEP, FINISH):
                raise ValueError(f"the pi05 engine has no op {item.op!r}")
            by_op[item.op].append(i)
        outputs: list[EngineOutput | None] = [None] * len(items)
        with torch.inference_mode():
            for op, run in ((PREFILL, self._prefill), (STEP, self._step), (FINISH, self._finish)):
                if by_op[op]:
                    for i, out in zip(by_op[op], run([items[i] for i in by_op[op]]), strict=True):
                        outputs[i] = EngineOutput(out)
        return outputs  # type: ignore[return-value]

    def _prefill(self, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        model, chunk = self.model, self.model.config.chunk_size
        tokens_per_image = model.config.tokens_per_image
        lengths = []
        for item in items:
            self.release(item.request_id)  # a retried prefill starts over
            length = len(item.inputs["pixels"]) * tokens_per_image + len(item.inputs["prompt_ids"])
            self.pool.reserve(item.request_id, length + chunk)
            self.prefix_lens[item.request_id] = length
            lengths.append(length)
        request_ids = [item.request_id for item in items]
        # one host-to-device copy of every image (a copy per request waits on each)
        pixels = torch.cat([item.inputs["pixels"] for item in items])
        counts = [len(item.inputs["pixels"]) for item in items]
        if self.prefill_graphs is not None and len(set(counts)) == 1 and counts[0]:
            start = 0
            for size, rows in self.prefill_parts(len(items)):
                part = slice(start, start + size)
                self._prefill_graphed(items[part], request_ids[part],
                                      pixels[start * counts[0]:(start + size) * counts[0]], rows)
                start += size
        else:
            images = model.encode_images(to_device(pixels, self.device)).split(counts)
            ids = [to_device(item.inputs["prompt_ids"], self.device) for item in items]
            keys = self.prefix_keys(request_ids, lengths)
            model.prefill(model.embed_prefix(images, ids), self.caches, ChunkKeys(*self._on_device(keys)))
        return [{"prefix": torch.tensor([n])} for n in lengths]

    def prefill_parts(self, count: int) -> list[tuple[int, int]]:
        """A graphed prefill of ``count`` requests as ``(requests, rows)`` parts, one replay
        each: the largest batch bucket that fits what is left, again and again (15 as 8, 4, 2, 1
        with the default buckets); a rest smaller than every bucket padded up to the smallest.

        Requests arrive from the front end in any number, and a graph per count (as until
        2026-12-07) met new counts long after warm-up, each one's capture (three forwards of
        the whole prefix) stalling its batch. Padding every count up to its bucket would cost
        up to a whole prefix of GPU work per padded row."""
        parts, rest = [], count
        while rest:
            size = next((b for b in reversed(self.batch_sizes) if b <= rest), None)
            if size is None:
                return [*parts, (rest, self.batch_sizes[0])]
            parts.append((size, size))
            rest -= size
        return parts

    def _prefill_graphed(self, items: list[EngineItem], request_ids: list[str], pixels: torch.Tensor,
                         rows: int) -> None:
        """The prefill replayed from a graph per (rows; images a request; prompt bucket): every
        prefix laid out as one row of its images' tokens and its prompt padded to a multiple of
        ``PROMPT_BUCKET`` (the padding written to the scratch page, never visible), the rows
        past the requests padding too."""
        images = len(items[0].inputs["pixels"])
        prompts = [item.inputs["prompt_ids"].reshape(-1) for item in items]
        width = -(-max(len(ids) for ids in prompts) // PROMPT_BUCKET) * PROMPT_BUCKET
        ids = torch.zeros(rows, width, dtype=torch.int64)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
        pad = (rows - len(items)) * images
        if pad:
            pixels = torch.cat([pixels, pixels.new_zeros(pad, *pixels.shape[1:])])
        image_tokens = images * self.model.config.tokens_per_image
        lengths = torch.tensor([image_tokens + len(ids) for ids in prompts])
        keys = self.row_keys(request_ids, lengths, rows, image_tokens + width)
        inputs = (pixels, ids, *keys)
        self.prefill_graphs((rows, images, width), *(to_device(t, self.device) for t in inputs))

    def row_keys(self, request_ids: list[str], lengths: torch.Tensor, rows: int,
                 length: int) -> tuple[torch.Tensor, ...]:
        """A prefill of ``rows`` rows of ``length`` tokens each, request ``b``'s first
        ``lengths[b]`` real: ``ChunkKeys``' first four fields, every other token written to the
        scratch page and seen by no one."""
        page_size = self.pool.page_size
        slots, key_slots, visible = self._key_grid(request_ids, lengths, length)
        scratch = self.scratch * page_size + torch.arange(length) % page_size
        pad = rows - len(request_ids)
        if pad:
            slots = torch.cat([slots, scratch.expand(pad, length)])
            key_slots = torch.cat([key_slots, scratch.expand(pad, length)])
            visible = torch.cat([visible, (torch.arange(length) == 0).expand(pad, length)])
        write_slots = torch.where(visible, slots, scratch)
        positions = torch.arange(length).expand(rows, length)
        return positions.reshape(-1), write_slots.reshape(-1), key_slots, visible

    def _prefill_rows(self, pixels: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                      write_slots: torch.Tensor, key_slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """What a prefill graph records: ``pixels [rows * images, 3, S, S]`` and prompts ``ids
        [rows, width]`` through SigLIP and the language model into the cache (tensors only)."""
        model = self.model
        rows = ids.shape[0]
        images = model.encode_images(pixels).reshape(rows, -1, model.config.text.hidden_size)
        text = model.language_model.embed(ids)
        embeds = torch.cat([images.to(text.dtype), text], dim=1).reshape(-1, text.shape[-1])
        hidden = model.prefill(embeds, self.caches, ChunkKeys(positions, write_slots, key_slots, visible))
        return hidden[:1]

    def _key_grid(self, request_ids: list[str], lengths: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        """Each request's flat cache slots of positions ``0 .. length-1`` ``[B, length]``, those
        past its ``lengths[b]`` pointing at its first slot, and which are real."""
        page_size = self.pool.page_size
        tables = self.pool.tables(request_ids)
        width = max(len(t) for t in tables)
        table = torch.tensor([list(t) + [t[0]] * (width - len(t)) for t in tables])
        pos = torch.arange(length)
        slots = table[:, (pos // page_size).clamp(max=width - 1)] * page_size + pos % page_size
        visible = pos[None, :] < lengths[:, None]
        return slots, torch.where(visible, slots, slots[:, :1]), visible

    def prefix_keys(self, request_ids: list[str], lengths: list[int]) -> ChunkKeys:
        """A prefill of prefixes of ``lengths`` as host ``ChunkKeys``: the flat tokens gathered
        into one row per request, padded to the longest."""
        sizes = torch.tensor(lengths)
        slots, key_slots, visible = self._key_grid(request_ids, sizes, max(lengths))
        total = int(sizes.sum())
        firsts = torch.cumsum(sizes, 0) - sizes
        pos = torch.arange(key_slots.shape[1])
        query_rows = torch.where(visible, firsts[:, None] + pos, total)
        order = (torch.arange(len(lengths))[:, None] * key_slots.shape[1] + pos).masked_select(visible)
        return ChunkKeys(pos.expand_as(slots).masked_select(visible), slots.masked_select(visible), key_slots,
                         visible, query_rows, order)

    def _step(self, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        count = len(items)
        rows = next((b for b in self.batch_sizes if b >= count), None) if self.graphs is not None else None
        steps = torch.tensor([float(item.params["num_steps"]) for item in items])
        dt = -1.0 / steps
        time = 1.0 + torch.tensor([float(item.iteration) for item in items]) * dt
        # host inputs (the times, a chunk's first noise) go up without waiting for the device: a
        # blocking copy waits for every queued kernel, once a step
        x = torch.stack([to_device(item.inputs["actions"], self.device).float() for item in items])
        keys = self.chunk_keys([item.request_id for item in items], rows or count, rows is not None)
        self.forward_rows = [*self.forward_rows[-1023:], count]
        if rows is None:
            inputs = (x, to_device(time, self.device), to_device(dt, self.device), *self._on_device(keys)[:4])
            return [{"actions": row} for row in self._denoise(*inputs)]
        length = keys.key_slots.shape[1]
        if length not in self.step_lengths:
            self.step_lengths.add(length)
            self._capture_steps(length)
        out = self.graphs((rows, length), *self._step_inputs(x, time, dt, keys, rows))
        return [{"actions": row} for row in out[:count]]

    def _step_inputs(self, x: torch.Tensor, time: torch.Tensor, dt: torch.Tensor, keys: ChunkKeys,
                     rows: int) -> tuple[torch.Tensor, ...]:
        """A graphed step's inputs on the device, the rows past ``x``'s padding (at time 1
        with step 0)."""
        pad = rows - len(x)
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        time, dt = torch.cat([time, torch.ones(pad)]), torch.cat([dt, torch.zeros(pad)])
        return x, to_device(time, self.device), to_device(dt, self.device), *self._on_device(keys)[:4]

    def _capture_steps(self, length: int) -> None:
        """Capture a step of every batch bucket at key length ``length``, over padding rows
        only (their writes go to the scratch page). A step's count of requests depends on when
        they arrived (16 submitted together ran as steps of 1, 2, 8 and 16 on an H100): captured
        one by one as each count first came, every capture stalled its batch by ~0.2 s long
        after warm-up (the prefix lengths, hence the key buckets, are fewer)."""
        x = torch.zeros(0, self.model.config.chunk_size, self.model.config.max_action_dim, device=self.device)
        for rows in reversed(self.batch_sizes):  # the largest first: the graphs' pool is sized once
            if (rows, length) not in self.graphs.inputs:
                keys = self.chunk_keys([], rows, True, length)
                self.graphs((rows, length), *self._step_inputs(x, torch.zeros(0), torch.zeros(0), keys, rows))

    def chunk_keys(self, request_ids: list[str], rows: int, bucket: bool, length: int | None = None) -> ChunkKeys:
        """The step of ``request_ids`` (each writing its chunk after its prefix) as host
        ``ChunkKeys`` over ``rows >= len(request_ids)`` rows: the rows past the requests write
        to and read the scratch page. ``bucket``: the key length rounded up to ``KEY_BUCKET``;
        ``length``: that length given (a capture's padding rows only, ``request_ids`` empty)."""
        chunk, page_size = self.model.config.chunk_size, self.pool.page_size
        starts = torch.tensor([self.prefix_lens[r] for r in request_ids], dtype=torch.int64)
        if length is None:
            length = int(starts.max()) + chunk
            if bucket:
                length = -(-length // KEY_BUCKET) * KEY_BUCKET
        pos = torch.arange(length)
        if request_ids:
            slots, key_slots, visible = self._key_grid(request_ids, starts + chunk, length)
            positions = starts[:, None] + torch.arange(chunk)
            write_slots = slots.gather(1, positions)
        else:
            positions = write_slots = torch.zeros(0, chunk, dtype=torch.int64)
            key_slots, visible = torch.zeros(0, length, dtype=torch.int64), torch.zeros(0, length, dtype=torch.bool)
        pad = rows - len(request_ids)
        if pad:
            scratch = self.scratch * page_size
            positions = torch.cat([positions, torch.arange(chunk).expand(pad, chunk)])
            write_slots = torch.cat([write_slots, scratch + torch.arange(chunk).expand(pad, chunk) % page_size])
            key_slots = torch.cat([key_slots, torch.full((pad, length), scratch)])
            visible = torch.cat([visible, pos[None, :].expand(pad, length) == 0])
        return ChunkKeys(positions.reshape(-1), write_slots.reshape(-1), key_slots, visible)

    def _on_device(self, keys: ChunkKeys) -> tuple[torch.Tensor, ...]:
        # the fields one by one: dataclasses.astuple would deep-copy every tensor first; each
        # through pinned memory (a pageable copy may make the host wait for the queued kernels)
        return tuple(None if t is None else to_device(t, self.device)
                     for t in (getattr(keys, f.name) for f in dataclasses.fields(keys)))

    def _denoise(self, x: torch.Tensor, time: torch.Tensor, dt: torch.Tensor, positions: torch.Tensor,
                 write_slots: torch.Tensor, key_slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One Euler step of every row: ``x [B, chunk, max_action_dim]`` at ``time [B]`` plus
        ``dt [B]`` times its velocity (what a graph records; tensors only)."""
        keys = ChunkKeys(positions, write_slots, key_slots, visible)
        return x + dt[:, None, None] * self.model.velocity(x, time, self.caches, keys)

    def _finish(self, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        out = []
        for item in items:
            embodiment = self.embodiments(item.params.get("embodiment", ""))
            width = int(item.params["action_dim"])
            actions = item.inputs["actions"].float().cpu()[:, :width]
            out.append({"action": embodiment.action.unnormalize(actions).contiguous()})
            self.release(item.request_id)
        return out

    def release(self, request_id: str) -> None:
        if self.pool.has(request_id):
            self.pool.free(request_id)
        self.prefix_lens.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return {"kv_pages_used": float(self.pool.num_used_pages)}
