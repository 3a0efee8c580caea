"""GLM-5.2 chat (``zai-org/GLM-5.2-FP8``): the declaration.

One autoregressive node, the decoder, walked as a prefill then a loop of decodes
(``mstar.model.chat``); its paged cache holds one latent row per token and layer
(``Glm52ForCausalLM.cache_shape``, a ``planes=1`` ``KVLayout``). Tensor parallelism splits the
attention heads and every expert's features (``parallel_dims``); the default deployment is
``configs/glm52.yaml`` (TP8). The weights are never downloaded: ``model_path`` names a local
copy of the release (``checkpoint.py``).
"""

from __future__ import annotations

import torch

from mstar.distributed.dims import ParallelDims
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.chat import ChatLLM
from mstar.model.glm52.checkpoint import Glm52Checkpoint
from mstar.model.glm52.knobs import Glm52Knobs
from mstar.model.registry import register

LLM = "llm"


@register
class Glm52Chat(ChatLLM):
    key = "glm52"
    default_weights = "zai-org/GLM-5.2-FP8"
    tasks = frozenset({"chat", "text_completion"})
    Knobs = Glm52Knobs
    knobs: Glm52Knobs

    def graph(self) -> Graph:
        llm = Node(LLM, "autoregressive", inputs=("prompt_ids", "token"), outputs=("token",),
                   ops=("prefill", "decode"), flags=("stop",))
        prefill = Step(LLM, "prefill", reads="prompt_ids", writes="token", emit=Emit("token", "text"))
        decode = Step(LLM, "decode", reads="token", writes="token", emit=Emit("token", "text"))
        chat = Walk("chat", Sequential(prefill, Loop(decode, until="stop", max_iters="max_decode_steps")),
                    inputs="prompt_ids")
        return Graph.build([llm], [chat])

    def checkpoint(self) -> Glm52Checkpoint:
        return Glm52Checkpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.tokenizer = ckpt.tokenizer()
        self.stop_token_ids = self.stop_ids(list(ckpt.config().eos_token_id))

    def parallel_dims(self) -> dict[str, ParallelDims]:
        config = self.checkpoint().config()
        return {LLM: ParallelDims(tensor={"num_attention_heads": config.num_attention_heads,
                                          "intermediate_size": config.intermediate_size,
                                          "moe_intermediate_size": config.moe_intermediate_size})}

    def build_engines(self, nodes: set[str], device: torch.device):
        model = self.checkpoint().load_model(device, self.config.torch_dtype(),
                                             dummy=self.config.load_format == "dummy", seed=self.knobs.seed,
                                             fp8_gemm=self.knobs.fp8_gemm)
        kv = self.config.resources.kv_cache
        engine = AutoregressiveEngine(model, KVLayout(*model.cache_shape()), num_pages=kv.max_num_pages,
                                      page_size=kv.page_size, max_seq_len=self.config.max_seq_len, device=device,
                                      dtype=self.config.torch_dtype(), overlap_scheduling=self.knobs.overlap_scheduling,
                                      prefix_caching=self.knobs.prefix_caching,
                                      max_prefill_tokens=self.knobs.max_prefill_tokens)
        return {LLM: engine} if LLM in nodes else {}
