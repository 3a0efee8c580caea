"""The speech-token LM (``mstar.model.cosyvoice3.lm``) against CosyVoice's ``Qwen2LM`` (the
CosyVoice2 layout) and ``CosyVoice3LM``, recorded by ``record_reference.py`` from the official
code (commit ace7c47, torch 2.13, transformers 5.25; the installed ``cosyvoice-minicpmo``'s
``llm.py`` needs torchaudio, which the project venv lacks, so neither runs live here).

Each model is loaded from its released ``llm.pt`` layout (strict both ways) and decodes the
recorded request through the paged KV cache, batched with a second request that joins
mid-way: the speech logits of every step must match the reference's KV-cached greedy
decode within 1e-5 of their peak, and the greedy tokens must be the reference's.
"""

from __future__ import annotations

import pytest
import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.cosyvoice3 import SpeechLM, SpeechLMConfig, length_bounds, llm_name_map, qwen2_config
from mstar.model.weights import WeightLoadError, load_weights
from tests.cosyvoice3.record_reference import text_embedding
from tests.support.pages import Pages

TOL = 1e-5
LAYOUTS = ["cosyvoice2", "cosyvoice3"]


def build(case: dict, layout: str) -> SpeechLM:
    qwen2 = case["qwen2"]
    config = SpeechLMConfig(backbone=qwen2_config(qwen2), speech_token_size=case["speech_token_size"], layout=layout)
    model = SpeechLM(config).eval()
    embed = text_embedding(qwen2["vocab_size"], qwen2["hidden_size"])
    released = {**case["state"], "llm.model.model.embed_tokens.weight": embed, "llm.model.lm_head.weight": embed}
    load_weights(model, released.items(), name_map=llm_name_map)  # strict: every name used, every parameter filled
    return model


def peak_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_reference_at_every_paged_step(reference, layout: str) -> None:
    case = reference["lm"][layout]
    model = build(case, layout)
    config = model.config
    layers, kv_heads, head_dim = model.cache_shape()
    caches = allocate_kv_cache(layers, 32, 4, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    pages = Pages(32, 4, seed=1)
    text_ids = torch.cat([case["prompt_text"], case["text"]])
    other = (torch.tensor([30, 31, 151646, 40]), torch.tensor([1, 2]))  # a second request, joining at step 1
    min_len, _ = length_bounds(config, len(case["text"]))
    got, tokens, other_token = [], [], None
    with torch.no_grad():
        for step in range(len(case["logits"])):
            seqs, rows = ["a"], [model.prompt_ids(text_ids, case["prompt_speech"]) if step == 0
                                 else torch.tensor([tokens[-1]])]
            if step >= 1:
                seqs.append("b")
                rows.append(model.prompt_ids(*other) if step == 1 else torch.tensor([other_token]))
            meta = pages.step([(s, r.shape[0]) for s, r in zip(seqs, rows)])
            hidden = model(torch.cat(rows), meta, caches)
            ends = meta.query_start_loc[1:] - 1
            logits = model.compute_logits(hidden[ends])
            got.append(logits[0])
            scores = logits[0].log_softmax(-1)
            if step < min_len:
                scores[config.speech_token_size] = -float("inf")  # the reference's ignore_eos
            tokens.append(int(scores.argmax()))
            other_token = int(logits[-1][:config.speech_token_size].argmax())
    err = peak_err(torch.stack(got), case["logits"])
    print(f"[parity] {layout} LM logits over {len(got)} steps: max err {err:.2e} of peak")
    assert err <= TOL
    assert tokens == case["tokens"]


def test_prompt_layout_places_special_rows(reference) -> None:
    case = reference["lm"]["cosyvoice3"]
    model = build(case, "cosyvoice3")
    s = model.config.speech_token_size
    text_ids = torch.cat([case["prompt_text"], case["text"]])
    rows = model.prompt_embeddings(text_ids, case["prompt_speech"])
    assert rows.shape[0] == 1 + len(text_ids) + 1 + len(case["prompt_speech"])
    assert torch.equal(rows[0], model.speech_embedding.weight[s])  # sos
    assert torch.equal(rows[1 + len(text_ids)], model.speech_embedding.weight[s + 2])  # task id
    assert torch.equal(rows[-1], model.speech_embedding.weight[case["prompt_speech"][-1]])
    assert model.config.eos_id == s + 1 and list(model.config.stop_ids) == list(range(s, s + 200))
    with pytest.raises(ValueError, match="endofprompt"):
        model.prompt_embeddings(case["text"], case["prompt_speech"])


def test_llm_weights_refuse_a_missing_name(reference) -> None:
    case = reference["lm"]["cosyvoice3"]
    model = SpeechLM(SpeechLMConfig(backbone=qwen2_config(case["qwen2"]), speech_token_size=40))
    partial = {k: v for k, v in case["state"].items() if not k.endswith("self_attn.k_proj.bias")}
    with pytest.raises(WeightLoadError):
        load_weights(model, partial.items(), name_map=llm_name_map)


def test_qwen2_attention_biases() -> None:
    config = qwen2_config(dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1))
    attn = SpeechLM(SpeechLMConfig(backbone=config, speech_token_size=8)).llm.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        qwen2_config(dict(config.to_hf_dict(), use_sliding_window=True))
