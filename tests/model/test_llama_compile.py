"""``model_kwargs.compile`` on the CPU: the Llama decoder as ``torch.compile``d graphs
(inductor's C++ code; a decode step in one key block as one graph of every layer, the others
two graphs a layer around the eager attention) must decode as the eager model does.

A tiny random Llama (``LLAMA_TINY``, hidden 64, 2 layers), built twice from the same seed,
eager and compiled, each in float32 and with ``quantization: int4`` (the SmolLM2 path: our
block-quantised kernel where it builds, else bfloat16 activations into PyTorch's int4 kernel).
Checked: the logits of a prompt (a many-row step) and of its next token (a one-row decode step
through the paged cache), and the greedy tokens of three streams decoded together through the
engine, then of one stream alone. Steps of more than ``COMPILED_MAX_ROWS`` rows (per-layer
graphs: ``LAYER_GRAPH_MAX_ROWS``) run eagerly by design; the test raises the caps so that both
the one-row graphs and the many-row ones (dynamic rows, the prefill's halves around the eager
attention) are checked.

Why not exactly equal: inductor fuses RMSNorm's reduction and the RoPE arithmetic into loops
of its own, whose float32 sums may round in another order (measured max |diff| below 1e-5
relative to the largest logit in float32). In int4 a last-bit difference of an activation
can flip its rounding to bfloat16 before the product (a relative step of 2**-8), hence the
wider bound there; greedy tokens must still agree.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from benchmarks.common import tiny_llama_dir
from mstar.config import parse_config
from mstar.engine.base import EngineItem
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.layers.quantized import quantized_kernels_available
from mstar.model.llama import modeling
from mstar.model.llama.modeling import LlamaForCausalLM
from mstar.model.registry import model_class

FLOAT_TOL = 1e-5  # max |logit diff| / max |logit|, float32 weights
INT4_TOL = 2e-2  # the same with int4 weights (bfloat16 activations into the products)
PROMPTS = {"a": [3, 1, 4, 1, 5, 9, 2, 6], "b": [2, 7, 1, 8, 2, 8], "c": [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7]}


def _engine(path, quantization: str, compile: bool):
    config = parse_config({
        "model": "llama", "model_path": str(path), "load_format": "dummy", "device": "cpu", "dtype": "float32",
        "max_seq_len": 160, "max_concurrent_requests": 4,
        "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 4}},
        "model_kwargs": {"quantization": quantization, "compile": compile},
    }, "test")
    return model_class("llama")(config).build_engines({"llm"}, torch.device("cpu"))["llm"]


def _logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits of a prefill of ``ids`` (one step of ``len(ids)`` rows), then of one more token
    (a one-row decode step reading the cache): ``[len(ids) + 1, vocab]``."""
    n, page, pages = len(ids), 4, 64  # the engine's pool: a cache of another shape would trace anew
    layers, heads, dim = model.cache_shape()
    caches = allocate_kv_cache(layers, pages, page, heads, dim, torch.float32, "cpu")

    def step(tokens: list[int], start: int) -> torch.Tensor:
        end = start + len(tokens)
        meta = PagedAttentionMetadata(positions=torch.arange(start, end), slot_mapping=torch.arange(start, end),
                                      query_start_loc=torch.tensor([0, len(tokens)]), seq_lens=torch.tensor([end]),
                                      page_table=torch.arange(pages)[None], page_size=page)
        return model.compute_logits(model(torch.tensor(tokens), meta, caches))

    with torch.inference_mode():
        prompt = step(ids, 0)
        return torch.cat([prompt, step([int(prompt[-1].argmax())], n)])


def _greedy(engine, steps: int) -> dict[str, list[int]]:
    """Three streams prefilled in one step and decoded together, then ``a`` alone."""
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": 100, "stop_token_ids": []}
    items = [EngineItem(rid, "prefill", 0, {"prompt_ids": torch.tensor(p)}, params) for rid, p in PROMPTS.items()]
    out = {item.request_id: [int(o.outputs["token"])] for item, o in zip(items, engine.run(items))}
    for rids in [list(PROMPTS)] * steps + [["a"]] * steps:
        items = [EngineItem(rid, "decode", 0, {"token": torch.tensor([out[rid][-1]])}, {}) for rid in rids]
        for rid, o in zip(rids, engine.run(items)):
            out[rid].append(int(o.outputs["token"]))
    for rid in PROMPTS:
        engine.release(rid)
    return out


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_compiled_step_decodes_as_eager(tmp_path, quantization):
    if quantization != "none" and not quantized_kernels_available():
        pytest.skip("this torch lacks the int4 CPU kernels")
    # past dynamo's recompile limit the graphs would silently run eagerly: fail instead
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), \
            mock.patch.object(modeling, "COMPILED_MAX_ROWS", 64), \
            mock.patch.object(modeling, "LAYER_GRAPH_MAX_ROWS", 64):
        _check_compiled_against_eager(tmp_path, quantization)


def _check_compiled_against_eager(tmp_path, quantization: str) -> None:
    path = tiny_llama_dir(tmp_path)
    eager, compiled = (_engine(path, quantization, flag) for flag in (False, True))
    assert compiled.model.model.layers[0].compiled is not None and eager.model.model.layers[0].compiled is None
    assert compiled.model.model.compiled_step is not None and eager.model.model.compiled_step is None
    ours, ref = _logits(compiled.model, PROMPTS["c"]), _logits(eager.model, PROMPTS["c"])
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[compile] {quantization}: max rel logit err {err:.2e}")
    assert err <= (FLOAT_TOL if quantization == "none" else INT4_TOL)
    assert _greedy(compiled, 6) == _greedy(eager, 6)


def test_compile_is_refused_on_cuda():
    from mstar.config import ConfigError
    from mstar.model.llama.knobs import LlamaKnobs

    with pytest.raises(ConfigError, match="compile"):
        LlamaKnobs.parse({"compile": True}, device="cuda")


def test_compile_without_a_cpp_compiler_is_a_config_error(monkeypatch):
    from mstar.config import ConfigError
    from mstar.model.llama import knobs
    from mstar.model.llama.knobs import LlamaKnobs

    monkeypatch.setattr(knobs.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="C\\+\\+ compiler"):
        LlamaKnobs.parse({"compile": True}, device="cpu")
    LlamaKnobs.parse({"compile": True, "compile_backend": "aot_eager"}, device="cpu")  # needs none
    LlamaKnobs.parse({}, device="cpu")


def test_steps_past_the_row_cap_run_eagerly(tmp_path):
    model = _engine(tiny_llama_dir(tmp_path), "none", False).model

    def graph(layer, x, *args):
        raise AssertionError(f"graph called at {x.shape[0]} rows")

    for layer in model.model.layers:
        layer.compiled = (graph, graph, graph)
    # the prompt (one row past the cap) runs eagerly, its next token (one row) in the graphs
    with pytest.raises(AssertionError, match="graph called at 1 rows"):
        _logits(model, (PROMPTS["c"] * 4)[:model.model.layers[0].compiled_rows + 1])
