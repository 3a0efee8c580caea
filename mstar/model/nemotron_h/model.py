"""Nemotron-H as a plain text chat LLM: the declaration.

One node, ``llm`` (the hybrid decoder); a chat walks ``chat``, Llama's walk: a prefill, then
a Loop of decodes until the engine raises ``stop``. Besides its KV pages (attention layers
only), every request holds one recurrent-state slot (every Mamba-2 layer's conv window and
SSM state) from its first step to its release, however it ends; the pool has
``resources.mamba_state.max_slots`` slots, one of them the sink, and the conductor admits
against both. Startup refuses a ``max_concurrent_requests`` the pool cannot hold.

The key serves the LLM of the duplex model (``nemotron_duplex``'s ``nano_llm``, issue 31) on
its own, for chat and text completions; it is not listed in the README's model table.
"""

from __future__ import annotations

import torch

from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.chat import ChatLLM
from mstar.model.decoding import state_capacity, state_slots
from mstar.model.nemotron_h.checkpoint import NemotronHCheckpoint
from mstar.model.nemotron_h.knobs import NemotronHKnobs
from mstar.model.registry import register
from mstar.model.spec import WalkRequest

STATE_SLOTS = "state_slots"
LLM = "llm"


@register
class NemotronHChat(ChatLLM):
    key = "nemotron_h"
    tasks = frozenset({"chat", "text_completion"})
    default_weights = "nvidia/NVIDIA-Nemotron-Nano-9B-v2"
    Knobs = NemotronHKnobs
    knobs: NemotronHKnobs
    kv_upfront = True  # its engine never preempts: a recurrent state is not recomputed

    def graph(self) -> Graph:
        llm = Node(LLM, "autoregressive", inputs=("prompt_ids", "token"), outputs=("token",),
                   ops=("prefill", "decode"), flags=("stop",))
        chat = Walk("chat", Sequential(
            Step(LLM, "prefill", reads="prompt_ids", writes="token", emit=Emit("token", "text")),
            Loop(Step(LLM, "decode", reads="token", writes="token", emit=Emit("token", "text")),
                 until="stop", max_iters="max_decode_steps"),
        ), inputs="prompt_ids")
        return Graph.build([llm], [chat])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> NemotronHCheckpoint:
        return NemotronHCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.tokenizer = ckpt.tokenizer()
        self.stop_token_ids = self.stop_ids(ckpt.config().eos_token_id, *ckpt.generation_eos())

    @property
    def max_slots(self) -> int:
        return state_slots(self.config, "mamba_state")

    def default_capacity(self) -> dict[str, int]:
        return super().default_capacity() | {STATE_SLOTS: state_capacity(self.config, "mamba_state")}

    def text_request(self, ids: list[int], max_tokens: int | None, sampling, ignore_eos: bool, *,
                     prompt_field: str = "messages") -> WalkRequest:
        request = super().text_request(ids, max_tokens, sampling, ignore_eos, prompt_field=prompt_field)
        request.cost[STATE_SLOTS] = 1
        return request

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.nemotron_h.engine import nemotron_h_engine

        if LLM not in nodes:
            return {}
        ckpt = self.checkpoint()
        dtype = self.config.torch_dtype()
        model = ckpt.load_model(device, dtype, dummy=self.config.load_format == "dummy", seed=self.knobs.seed)
        kv = self.config.resources.kv_cache
        return {LLM: nemotron_h_engine(
            model, max_slots=self.max_slots, state_dtype=self._state_dtype(model.config.mamba_ssm_cache_dtype),
            num_pages=kv.max_num_pages, page_size=kv.page_size, max_seq_len=self.config.max_seq_len,
            device=device, dtype=dtype, attention_backend=self.knobs.attention_backend)}

    def _state_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        """``resources.mamba_state.state_dtype``; ``auto``: the checkpoint's
        ``mamba_ssm_cache_dtype`` (float32 by default)."""
        pool = self.config.resources.mamba_state
        name = pool.state_dtype if pool is not None and pool.state_dtype != "auto" else checkpoint_dtype
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"mamba_ssm_cache_dtype {name!r} is not a torch dtype")
        return dtype
