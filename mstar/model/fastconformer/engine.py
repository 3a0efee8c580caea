"""The transducer families' engines: the batched encoder (a stateless node) and the greedy
decoder, whose per-clip state lives in a recurrent-state slot pool.

A clip takes a slot at its first decode iteration and keeps it until ``release`` (the
runtime calls it however the request ends: done, failed, cancelled, disconnected). The slot
holds the prediction network's LSTM state and last output, the cursor, the tokens in a row
at the cursor's frame and the steps left; the clip's encoder frames stay beside it, keyed by
request. A decode iteration gathers the rows of every clip in the plan, runs at most
``steps_per_iteration`` greedy steps over all of them at once, writes the rows back and
returns each clip's new tokens (none: the output is silent this iteration) and, once its
cursor is past its last frame or its steps are spent, the ``stop`` flag.

On a GPU the steps run as ``device_steps`` (``model_kwargs.device_loop``): all of them queued
with no read of the device in between, and the tokens and end flags read back once when the
iteration ends; on the CPU the reference loop (``greedy_steps``), which skips finished rows.
With ``model_kwargs.cuda_graphs`` an iteration's steps (some two thousand small kernels at 64
steps) are one replay of a CUDA graph per batch bucket (``IterationGraphs``), and so is the
encoder's forward per batch and length bucket (``EncoderGraphs``).

The slot rows are written back only after the steps succeed, so a batch that fails leaves
every state as it was: the worker's item-by-item retry decodes from intact states.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate

import torch
from torch import nn

from mstar.engine.base import Engine, EngineItem, EngineOutput, StatelessEngine
from mstar.engine.cuda_graphs import GraphRunner, ShapeGraphs
from mstar.engine.state_pool import StatePool
from mstar.layers.paged_kv import to_device
from mstar.model.fastconformer.transducer import GreedyRows, TransducerModel, device_steps, greedy_steps

MIN_FRAMES = 16384  # the iteration graphs' first frame buffer: 32 clips of 30 s (80 ms frames) and more


class EncoderGraphs:
    """The encoder's forward replayed from a CUDA graph per (batch bucket, length bucket): a
    batch of ``B`` clips of at most ``T`` log-mel frames runs padded to the smallest bucket of
    ``batch_sizes`` >= ``B`` and to ``T`` rounded up to ``frame_step`` frames; padding rows
    have no frames, padded frames are masked as in any batch, so each clip's frames are those
    of the eager forward (to the kernels' rounding). At one clip the eager encoder is launch
    bound (~1,100 small kernels, ~35 ms of host time a 30 s clip on an H200 host, against ~1
    ms of GPU work). Batches longer than ``max_frames``, larger than the last bucket, or past
    ``max_graphs`` keys run eagerly."""

    def __init__(self, model: TransducerModel, lookahead: int | None, batch_sizes: Iterable[int], *,
                 frame_step: int = 1000, max_frames: int = 3000, max_graphs: int = 16) -> None:
        self.model, self.lookahead = model, lookahead
        self.batch_sizes = tuple(sorted({int(n) for n in batch_sizes}))
        self.frame_step, self.max_frames = frame_step, max_frames
        self.graphs = ShapeGraphs(self._forward, model.encoder_projector.weight.device, max_graphs)

    def _forward(self, mel: torch.Tensor, lengths: torch.Tensor, *prompts: torch.Tensor) -> torch.Tensor:
        return self.model.encode(mel, lengths, prompts[0] if prompts else None, lookahead=self.lookahead)[0]

    def shape(self, batch: int, frames: int) -> tuple[int, int] | None:
        """The padded ``(batch, frames)`` a batch replays at, or None: eager."""
        if batch > self.batch_sizes[-1] or frames > self.max_frames:
            return None
        return next(n for n in self.batch_sizes if n >= batch), -(-frames // self.frame_step) * self.frame_step

    def __call__(self, mel: torch.Tensor, lengths: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
        """The encoder's joint-side frames ``[bucket, T', width]`` of a padded batch (its
        shape a bucket's: ``shape``)."""
        inputs = (mel, lengths) if prompts is None else (mel, lengths, prompts)
        return self.graphs(tuple(mel.shape), *inputs)


def encoder_fn(model: TransducerModel, lookahead: int | None, graphs: EncoderGraphs | None = None):
    """The encoder node: every clip of the plan in one padded forward (a replay of ``graphs``
    where a bucket holds the batch);
    each gets back its own joint-side frames (``audio_features`` ``[T_i, width]``). A clip may
    carry its language prompt (``prompt``, one int)."""
    config = model.config

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = model.encoder_projector.weight
        mels = [item.inputs["mel"] for item in items]
        sizes = [m.shape[0] for m in mels]
        prompts = None
        if config.num_prompts:
            prompts = [int(item.inputs["prompt"].reshape(-1)[0]) if "prompt" in item.inputs
                       else config.default_prompt_id for item in items]
        shape = graphs.shape(len(items), max(sizes)) if graphs is not None else None
        batch, frames = shape or (len(items), max(sizes))
        mel = torch.zeros(batch, frames, mels[0].shape[1], device=weight.device, dtype=weight.dtype)
        for row, clip in enumerate(mels):
            mel[row, :clip.shape[0]] = clip.to(weight.device)
        lengths = torch.tensor(sizes + [0] * (batch - len(items)), dtype=torch.int64).to(weight.device)
        if prompts is not None:
            prompts = torch.tensor(prompts + [config.default_prompt_id] * (batch - len(items)),
                                   dtype=torch.int64).to(weight.device)
        if shape is not None:
            out = graphs(mel, lengths, prompts)
            return [{"audio_features": f[:config.encoder.frames(n)]} for f, n in zip(out, sizes)]
        out, lengths = model.encode(mel, lengths, prompts, lookahead=lookahead)
        return [{"audio_features": f[:n]} for f, n in zip(out, lengths.tolist())]

    return run


class IterationGraphs:
    """A decode iteration (``device_steps`` of ``steps`` steps) replayed from a CUDA graph per
    batch bucket of ``batch_sizes``. The rows' state is copied into static buffers (a bucket's
    padding rows have no frames and no steps, so they change nothing) and their frames, one
    clip after the other, into a frame buffer; when a batch's frames outgrow it, the buffer
    doubles and the graphs are captured again over the new one. Off CUDA the same buffers
    and buckets run eagerly (``GraphRunner``), which is how the CPU tests check them."""

    def __init__(self, model: TransducerModel, steps: int, batch_sizes: Iterable[int], device: torch.device,
                 dtype: torch.dtype, min_frames: int = MIN_FRAMES) -> None:
        self.model, self.steps, self.device = model, steps, device
        self.batch_sizes = tuple(sorted({int(n) for n in batch_sizes}))
        n = self.batch_sizes[-1]
        layers, width = model.config.num_decoder_layers, model.config.decoder_hidden_size
        self.state = {"hidden": torch.zeros(layers, n, width, device=device, dtype=dtype),
                      "cell": torch.zeros(layers, n, width, device=device, dtype=dtype),
                      "output": torch.zeros(n, width, device=device, dtype=dtype)}
        self.state |= {name: torch.zeros(n, dtype=torch.int64, device=device)
                       for name in ("lengths", "cursor", "symbols", "budget", "offsets")}
        self._allocate(torch.zeros(min_frames, width, device=device, dtype=dtype))

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _allocate(self, frames: torch.Tensor) -> None:
        self.frames = frames
        self.runner = GraphRunner(self._step, self.device)

    def _step(self, bucket: int) -> tuple[GreedyRows, torch.Tensor]:
        """What a graph records: the iteration over the first ``bucket`` rows."""
        s = self.state
        rows = GreedyRows(frames=self.frames, lengths=s["lengths"][:bucket], hidden=s["hidden"][:, :bucket],
                          cell=s["cell"][:, :bucket], output=s["output"][:bucket], cursor=s["cursor"][:bucket],
                          symbols=s["symbols"][:bucket], budget=s["budget"][:bucket], offsets=s["offsets"][:bucket])
        return rows, device_steps(self.model, rows, self.steps)

    def run(self, rows: GreedyRows) -> tuple[GreedyRows, torch.Tensor]:
        """The rows after one iteration and its token table (``device_steps``'s), the first
        ``n`` rows of the replay's own tensors: read them before the next ``run``. ``rows``
        has its frames one after the other (``offsets``) and at most ``max_batch_size`` rows."""
        n, total = rows.cursor.shape[0], rows.frames.shape[0]
        bucket = next(size for size in self.batch_sizes if size >= n)
        if total > self.frames.shape[0]:
            grown = self.frames.shape[0]
            while grown < total:
                grown *= 2
            self._allocate(self.frames.new_zeros(grown, self.frames.shape[1]))
        self.frames[:total].copy_(rows.frames)
        s = self.state
        for name in ("output", "lengths", "cursor", "symbols", "budget", "offsets"):
            s[name][:n].copy_(getattr(rows, name))
        s["hidden"][:, :n].copy_(rows.hidden)
        s["cell"][:, :n].copy_(rows.cell)
        for name in ("lengths", "budget"):  # padding rows: nothing to decode
            s[name][n:bucket].zero_()
        if bucket not in self.runner:
            self.runner.prepare(bucket)
        out, table = self.runner.replay(bucket)
        return GreedyRows(frames=rows.frames, lengths=rows.lengths, hidden=out.hidden[:, :n], cell=out.cell[:, :n],
                          output=out.output[:n], cursor=out.cursor[:n], symbols=out.symbols[:n],
                          budget=out.budget[:n], offsets=rows.offsets), table[:n]


class TransducerDecoder(Engine):
    """The greedy decoder node over ``max_slots`` state slots (the last one the sink)."""

    def __init__(self, model: TransducerModel, *, max_slots: int, steps_per_iteration: int,
                 device: torch.device, dtype: torch.dtype, device_loop: bool | None = None,
                 graph_batch_sizes: Iterable[int] | None = None) -> None:
        if steps_per_iteration < 1:
            raise ValueError("steps_per_iteration must be >= 1")
        self.model = model
        self.steps = steps_per_iteration
        # the greedy steps with no read of the device inside (``device_steps``); default on a GPU
        self.device_loop = device.type == "cuda" if device_loop is None else device_loop
        # an iteration replayed from a CUDA graph per bucket (batches larger than the last
        # bucket run eagerly)
        self.graphs: IterationGraphs | None = None
        if graph_batch_sizes is not None:
            if not self.device_loop:
                raise ValueError("CUDA graphs replay the device loop: device_loop must be on")
            self.graphs = IterationGraphs(model, steps_per_iteration, graph_batch_sizes, device, dtype)
        self.slots = StatePool(max_slots)
        config = model.config
        layers, width = config.num_decoder_layers, config.decoder_hidden_size
        self.hidden = torch.zeros(layers, max_slots, width, device=device, dtype=dtype)
        self.cell = torch.zeros(layers, max_slots, width, device=device, dtype=dtype)
        self.output = torch.zeros(max_slots, width, device=device, dtype=dtype)
        counters = dict(device=device, dtype=torch.int64)
        self.cursor = torch.zeros(max_slots, **counters)
        self.symbols = torch.zeros(max_slots, **counters)
        self.budget = torch.zeros(max_slots, **counters)
        self.lengths = torch.zeros(max_slots, **counters)
        self.frames: dict[str, torch.Tensor] = {}

    def _take_slots(self, fresh: list[EngineItem]) -> None:
        """Slots for clips at their first iteration, set to the decoder's start state."""
        taken = []
        try:
            for item in fresh:
                taken.append(self.slots.allocate(item.request_id))
        except Exception:
            for item in fresh[:len(taken)]:
                self.slots.free(item.request_id)
            raise
        frames = [item.inputs["audio_features"].to(self.output.device, self.output.dtype) for item in fresh]
        index = to_device(torch.tensor(taken, dtype=torch.int64), self.output.device)
        with torch.no_grad():
            output, hidden, cell = self.model.start(len(fresh), self.output.device, self.output.dtype)
        self.output[index], self.hidden[:, index], self.cell[:, index] = output, hidden, cell
        lengths = to_device(torch.tensor([f.shape[0] for f in frames], dtype=torch.int64), self.output.device)
        self.lengths[index] = lengths
        self.cursor[index] = 0
        self.symbols[index] = 0
        self.budget[index] = lengths * self.model.config.max_symbols_per_step
        for item, clip in zip(fresh, frames):
            self.frames[item.request_id] = clip

    @torch.no_grad()
    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        fresh = [item for item in items if not self.slots.has(item.request_id)]
        if fresh:
            self._take_slots(fresh)
        index = torch.tensor([self.slots.slot(item.request_id) for item in items], dtype=torch.int64,
                             device=self.output.device)
        clips = [self.frames[item.request_id] for item in items]
        graphed = self.graphs is not None and len(items) <= self.graphs.max_batch_size
        if graphed:  # frames one after the other, as the graphs' frame buffer holds them
            starts = list(accumulate((clip.shape[0] for clip in clips[:-1]), initial=0))
            frames = torch.cat(clips)
            offsets = torch.tensor(starts, dtype=torch.int64).to(self.output.device, non_blocking=True)
        else:
            frames, offsets = nn.utils.rnn.pad_sequence(clips, batch_first=True), None
        rows = GreedyRows(
            frames=frames, lengths=self.lengths[index], hidden=self.hidden[:, index], cell=self.cell[:, index],
            output=self.output[index], cursor=self.cursor[index], symbols=self.symbols[index],
            budget=self.budget[index], offsets=offsets)
        if graphed:
            rows, table = self.graphs.run(rows)
        elif self.device_loop:
            table = device_steps(self.model, rows, self.steps)
        else:
            tokens = greedy_steps(self.model, rows, self.steps)
        self.hidden[:, index], self.cell[:, index], self.output[index] = rows.hidden, rows.cell, rows.output
        self.cursor[index], self.symbols[index], self.budget[index] = rows.cursor, rows.symbols, rows.budget
        ends = torch.stack([rows.cursor >= rows.lengths, rows.done()], dim=1).to(torch.int64)
        if self.device_loop:  # the iteration's one read of the device: tokens and end flags together
            read = torch.cat([table, ends], dim=1).tolist()
            tokens = [[t for t in r[:-2] if t >= 0] for r in read]
            ends_read = [r[-2:] for r in read]
        else:
            ends_read = ends.tolist()
        finished = [bool(e[0]) for e in ends_read]
        done = [bool(e[1]) for e in ends_read]
        outputs = []
        for said, end, out_of_frames in zip(tokens, done, finished):
            out = {"tokens": torch.tensor(said, dtype=torch.int64)} if said else {}
            reason = ("stop" if out_of_frames else "length") if end else None
            outputs.append(EngineOutput(out, flags=("stop",) if end else (), finish_reason=reason))
        return outputs

    def release(self, request_id: str) -> None:
        self.slots.free(request_id)
        self.frames.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return {"transducer_slots_used": self.slots.num_used, "transducer_slots_total": self.slots.capacity}


def transducer_engines(model: TransducerModel, nodes: set[str], *, max_slots: int, steps_per_iteration: int,
                       lookahead: int | None, device: torch.device, dtype: torch.dtype,
                       device_loop: bool | None = None,
                       graph_batch_sizes: Iterable[int] | None = None) -> dict[str, Engine]:
    """The engines of ``nodes`` (``encoder``, ``decoder``) over ``model``; ``graph_batch_sizes``:
    the encoder's and the decode iteration's CUDA-graph buckets (None: eager)."""
    engines: dict[str, Engine] = {}
    if "encoder" in nodes:
        graphs = EncoderGraphs(model, lookahead, graph_batch_sizes) if graph_batch_sizes is not None else None
        engines["encoder"] = StatelessEngine(encoder_fn(model, lookahead, graphs))
    if "decoder" in nodes:
        engines["decoder"] = TransducerDecoder(model, max_slots=max_slots, steps_per_iteration=steps_per_iteration,
                                               device=device, dtype=dtype, device_loop=device_loop,
                                               graph_batch_sizes=graph_batch_sizes)
    return engines
