"""Qwen3-TTS's talker step on the device: the talker's forward with its next inputs in a device
table (so a decode step reads nothing from the host and replays the engine's decode graphs,
and may be launched ahead), and the code predictor's frame per batch bucket (its ``Q - 1``
passes and their sampling, one CUDA graph a bucket).

**Next inputs** (``TalkerStepForward``): a step's next input (the frame's embedding sum plus
the next text row) is written by ``TalkerRules.choose`` into ``inputs [slots, 3, H]``, row
``slot`` of the request and place ``position % 3`` of the position that reads it. A decode
step's per-row graph input is that flat row index. Three places, not one: a step launched
ahead (overlap scheduling) writes the input of the position after next, and if it is
discarded and its step runs again, the input that step reads must still be there. The last
slot (the pool's sink) is the padded rows'.

**Frames** (``FramePredictor``): the code predictor over every row of a step (EOS rows too;
their frames are dropped), sampled by ``sampling.draw``, on a fresh frame-local cache of one
page of ``Q`` slots a row. With ``cuda_graphs`` each batch bucket's ``Q - 1`` passes replay
from one graph (``BucketGraphs``) over static inputs (the talker's hidden state, codebook 0,
the rows' noise keys, frame indexes and greedy flags); its page-attention metadata is built
once a bucket, outside the capture, as the Triton kernels derive their tiles from it. Off
CUDA the same buckets and padding run eagerly.
"""

from __future__ import annotations

import dataclasses

import torch

from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES, BucketGraphs
from mstar.engine.state_pool import StatePool
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.model.qwen3_omni.engine import TalkerForward
from mstar.model.qwen3_omni.talker import CodecFrame, frame_step_metadata
from mstar.model.qwen3_tts.sampling import draw
from mstar.model.qwen3_tts.talker import Qwen3TTSTalker

PLACES = 3  # input places per request: the ring a step launched ahead needs (module doc)


class TalkerStepForward(TalkerForward):
    """``TalkerForward`` whose decode inputs live on the device: decode steps replay graphs
    (graph row ``input_row``) and may be launched ahead. ``max_requests``: requests held at
    once (one table slot each)."""

    runs_ahead = True

    def __init__(self, talker: Qwen3TTSTalker, max_requests: int) -> None:
        super().__init__(talker)
        weight = talker.codec_head.weight
        self.slots = StatePool(max_requests + 1)
        self.inputs = torch.zeros(max_requests + 1, PLACES, talker.config.text.hidden_size, dtype=weight.dtype,
                                  device=weight.device)
        self.graph_rows = {"input_row": self.slots.sink * PLACES}

    def row(self, request_id: str, position: int) -> int:
        """The flat table row of the input that the request's ``position`` reads."""
        if not self.slots.has(request_id):
            self.slots.allocate(request_id)
        return self.slots.slot(request_id) * PLACES + position % PLACES

    def write(self, rows: list[int], values: torch.Tensor) -> None:
        """Next inputs ``values [B, H]`` into flat table ``rows``."""
        index = torch.tensor(rows, dtype=torch.int64)
        if values.device.type == "cuda":
            index = index.pin_memory().to(values.device, non_blocking=True)
        self.inputs.view(-1, self.inputs.shape[-1]).index_copy_(0, index, values.to(self.inputs.dtype))

    def prepare(self, items, input_ids, meta: PagedAttentionMetadata, counts) -> dict:
        lens = meta.seq_lens_list
        if counts is None:  # decodes only: the table rows, one per row (the graphs' input)
            rows = [self.row(item.request_id, lens[b] - 1) for b, item in enumerate(items)]
            index = torch.tensor(rows, dtype=torch.int64)
            if input_ids.device.type == "cuda":
                index = index.pin_memory().to(input_ids.device, non_blocking=True)
            return {"input_row": index}
        flat = self.inputs.view(-1, self.inputs.shape[-1])
        parts = []
        for b, item in enumerate(items):
            if item.op == "prefill":
                self.row(item.request_id, 0)  # its slot, for the next input its step writes
                parts.append(self.prompts[item.request_id].embeds)
            else:
                parts.append(flat[self.row(item.request_id, lens[b] - 1)][None])
        return {"embeds": torch.cat(parts)}

    def hidden(self, input_ids, meta, kv_caches, inputs, counts) -> torch.Tensor:
        embeds = inputs.get("embeds")
        if embeds is None:
            embeds = self.inputs.view(-1, self.inputs.shape[-1]).index_select(0, inputs["input_row"])
        return self.model(embeds, meta, kv_caches)

    def graph_step(self, input_ids, meta, kv_caches, rows) -> torch.Tensor:
        """The logits and the final hidden state side by side ``[B, V + H]``."""
        hidden = self.hidden(input_ids, meta, kv_caches, rows, None)
        return torch.cat((self.model.compute_logits(hidden), hidden.to(self.inputs.dtype)), dim=-1)

    def graph_logits(self, replayed: torch.Tensor) -> torch.Tensor:
        vocab = replayed.shape[-1] - self.inputs.shape[-1]
        self.last_hidden = replayed[:, vocab:]
        return replayed[:, :vocab]

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.slots.free(request_id)

    def stats(self) -> dict[str, float]:
        return {"talker_input_slots_used": self.slots.num_used}


class FramePredictor:
    """The code predictor's frames of a step's rows, drawn on the device (``sampling.draw``);
    replayed per batch bucket of ``batch_sizes`` with ``cuda_graphs``. ``backend``: the
    predictor's paged-attention kernels (``"triton"`` under graphs on CUDA)."""

    def __init__(self, talker: Qwen3TTSTalker, *, backend: str = "torch", cuda_graphs: bool = False,
                 batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> None:
        self.talker = talker
        self.backend = backend
        self.groups = talker.config.num_code_groups
        weight = talker.codec_head.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.plans: dict[int, tuple[list[PagedAttentionMetadata], list[torch.Tensor]]] = {}
        self.graphs: BucketGraphs | None = None
        if cuda_graphs:
            n, width = max(batch_sizes), talker.config.text.hidden_size
            ints = {name: torch.zeros(n, dtype=torch.int64, device=self.device)
                    for name in ("code0", "keys", "frames", "greedy")}
            buffers = {"hidden": torch.zeros(n, width, dtype=self.dtype, device=self.device)} | ints
            self.graphs = BucketGraphs(self._packed, buffers, dict.fromkeys(buffers, 0), batch_sizes)

    def __call__(self, hidden: torch.Tensor, code0: torch.Tensor, keys: torch.Tensor, frames: torch.Tensor,
                 greedy: torch.Tensor) -> CodecFrame:
        """The frames of ``B`` rows: ``hidden [B, H]``, ``code0 [B]``, each row's noise key,
        frame index and greedy flag (int64 ``[B]`` each, on the device)."""
        batch = hidden.shape[0]
        if self.graphs is not None and self.graphs.fits(batch):
            out = self.graphs.run(batch, {"hidden": hidden, "code0": code0, "keys": keys, "frames": frames,
                                          "greedy": greedy})
            return CodecFrame(out[:, :self.groups].long(), out[:, self.groups:].to(self.dtype))
        return self._frame(hidden, code0, keys, frames, greedy, plan=self._plan(batch))

    def capture_all(self) -> None:
        if self.graphs is not None:
            self.graphs.capture_all()

    def _frame(self, hidden, code0, keys, frames, greedy, plan) -> CodecFrame:
        flags = greedy.bool()
        metas, caches = plan
        return self.talker.code_predictor(hidden, code0, self.talker.embed_codec(code0),
                                          lambda scores, group: draw(scores, keys, frames, group, flags),
                                          metas=metas, caches=caches)

    def _packed(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """What a bucket's graph records: codes and embedding sum as one float32 ``[B, Q + H]``
        (codes are below ``2**24``, exact)."""
        frame = self._frame(rows["hidden"], rows["code0"], rows["keys"], rows["frames"], rows["greedy"],
                            plan=self._plan(rows["hidden"].shape[0]))
        return torch.cat((frame.codes.float(), frame.embeds.float()), dim=-1)

    def _plan(self, batch: int) -> tuple[list[PagedAttentionMetadata], list[torch.Tensor]]:
        """A batch size's per-pass metadata (with ``backend``, eager or not: the graphs and the
        eager frames run the same kernels) and frame cache, made once (for a bucket, before its
        capture). A frame writes every slot it reads, so the cache is reused as it is."""
        plan = self.plans.get(batch)
        if plan is None:
            groups, device = self.groups, self.device
            attn = self.talker.code_predictor.model.layers[0].self_attn
            steps = [(0, 2)] + [(start, 1) for start in range(2, groups)]
            metas = [dataclasses.replace(frame_step_metadata(batch, start, count, groups, device), backend=self.backend)
                     for start, count in steps]
            caches = allocate_kv_cache(len(self.talker.code_predictor.model.layers), batch, groups,
                                       attn.num_kv_heads, attn.head_dim, self.dtype, device)
            plan = self.plans[batch] = (metas, caches)
        return plan


__all__ = ["FramePredictor", "TalkerStepForward"]
