"""Pi0.5's engine: one node, ``policy``, holding the paged KV cache its two phases share.

Ops (ports in brackets):

- ``prefill`` [pixels, prompt_ids -> prefix]: reserve the request's pages (prefix plus one
  action chunk), encode every camera image of every request in the batch in one SigLIP
  forward, and run all their prefixes through the language model in one forward. ``prefix``
  is the prefix length, a marker the denoise steps read.
- ``step`` [actions, prefix -> actions]: one Euler step of the flow from time 1 to 0, for every
  request in the batch in one expert forward (each at its own iteration and step count).
- ``finish`` [actions -> action]: the chunk cut to the embodiment's action width and
  unnormalised with its statistics, float32 on the host; the pages are freed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.engine.page_pool import PagePool
from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.pi05.checkpoint import Embodiment
from mstar.model.pi05.modeling import Pi05Policy, step_metadata

PREFILL, STEP, FINISH = "prefill", "step", "finish"


class Pi05Engine(Engine):
    def __init__(self, model: Pi05Policy, embodiments: Callable[[str], Embodiment], device: torch.device,
                 dtype: torch.dtype, num_pages: int, page_size: int):
        self.model = model
        self.embodiments = embodiments
        self.device = device
        self.dtype = dtype
        self.pool = PagePool(num_pages, page_size)
        dims = model.config.text
        self.caches = allocate_kv_cache(dims.num_layers, num_pages, page_size, dims.num_kv_heads, dims.head_dim,
                                        dtype, device)
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
        pixels = [item.inputs["pixels"].to(self.device, self.dtype) for item in items]
        counts = [len(p) for p in pixels]
        images = model.encode_images(torch.cat(pixels)).split(counts)
        ids = [item.inputs["prompt_ids"].to(self.device) for item in items]
        tables = self.pool.tables([item.request_id for item in items])
        meta = step_metadata(tables, [0] * len(items), lengths, self.pool.page_size, self.device)
        model.prefill(model.embed_prefix(images, ids), self.caches, meta)
        return [{"prefix": torch.tensor([n])} for n in lengths]

    def _step(self, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        chunk = self.model.config.chunk_size
        ids = [item.request_id for item in items]
        starts = [self.prefix_lens[r] for r in ids]
        meta = step_metadata(self.pool.tables(ids), starts, [chunk] * len(items), self.pool.page_size, self.device)
        steps = torch.tensor([float(item.params["num_steps"]) for item in items], device=self.device)
        dt = -1.0 / steps
        time = 1.0 + torch.tensor([float(item.iteration) for item in items], device=self.device) * dt
        x = torch.stack([item.inputs["actions"].to(self.device, torch.float32) for item in items])
        self.forward_rows = [*self.forward_rows[-1023:], len(items)]
        x = x + dt[:, None, None] * self.model.velocity(x, time, self.caches, meta)
        return [{"actions": row} for row in x]

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
