"""Checkpoint folders without weights for the multi-GPU runs (``benchmarks/multi_gpu.py``):
each model's ``config.json`` at its released shapes (or a tiny one for ``--smoke``) and a
byte-level tokenizer with exactly ``vocab_size`` ids, so that a deployment with
``load_format: dummy`` starts with no download and every sampled id decodes to text.

The shapes are the released configs as the repository records them:

* Qwen3.8-27B: ``tests/distributed/test_qwen3_5_tp.py`` (``QWEN3_8_27B``, the text
  config) and the vision tower's defaults in ``mstar/model/qwen3_5/config.py``
  (``Qwen3_5VisionConfig``, the Qwen3.5 release's; its output width is the text width).
* Command A+: ``docs/command_a_plus.md`` and S16 (hidden 8192, 64 heads and 8 KV heads of
  128, 128 experts of 2048, top 8, one shared expert averaged in, tied vocabulary of
  256,000, 32 layers): the release's ``config.json`` was not at hand when those were
  recorded; 32 layers of these bring the decoder to ~215B of the stated 218B.
* GLM-5.2: ``Glm52Config``'s defaults (``mstar/model/glm52/config.py``), the release's
  ``config.json`` with three dense layers first and its fp8 ``quantization_config``.

``num_hidden_layers`` may be lowered (``layers``) where the whole model does not fit the
cards: the widths stay the released ones. The test ``tests/benchmarks/test_multi_gpu.py``
checks these dicts against the records above.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.common import LLAMA_3_1_8B, LLAMA_TINY, _filler_token, tiny_llama_dir

QWEN3_8_27B_TEXT: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
}
QWEN3_8_27B_VISION: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304,
}
QWEN_TINY_TEXT: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
}
QWEN_TINY_VISION: dict[str, Any] = {
    "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 4,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16,
}
# the rotary settings the Qwen3.5 release uses (a quarter of each head rotated, interleaved MRoPE)
QWEN_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
             "mrope_section": [11, 11, 10], "mrope_interleaved": True}
QWEN_TINY_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                  "mrope_section": [2, 1, 1], "mrope_interleaved": True}

COMMAND_A_PLUS: dict[str, Any] = {
    "vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 2048, "num_hidden_layers": 32,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "num_shared_experts": 1, "shared_expert_combination_strategy": "average",
    "expert_selection_fn": "softmax", "sliding_window": 4096, "sliding_window_pattern": 4,
    "max_position_embeddings": 131072, "tie_word_embeddings": True,
}
COMMAND_TINY: dict[str, Any] = {
    **COMMAND_A_PLUS, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 3,
    "sliding_window": 8, "max_position_embeddings": 4096,
}

GLM_5_2: dict[str, Any] = {
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64, "v_head_dim": 256, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "first_k_dense_replace": 3, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752,
    "tie_word_embeddings": False, "hidden_act": "silu", "scoring_func": "sigmoid",
}
GLM_TINY: dict[str, Any] = {
    **GLM_5_2, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 80, "moe_intermediate_size": 24,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 2,
    "num_experts_per_tok": 3, "q_lora_rank": 40, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 12, "index_topk": 16, "index_head_dim": 16, "index_n_heads": 16, "first_k_dense_replace": 1,
    "max_position_embeddings": 4096,
}


# ------------------------------------------------------------------------ the tokenizer
def ascii_byte_tokens() -> list[str]:
    """The byte-level (GPT-2) symbols of the bytes 0-127, in byte order: printable bytes are
    their own symbol, the others take the code points from 256 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols, shifted = [], 0
    for byte in range(128):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def write_tokenizer(path: Path, vocab_size: int, specials: list[str], eos: str, template: str) -> dict[str, int]:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids in ``path``: the 128 ASCII
    byte tokens, filler words (common.tiny_llama_dir's), then ``specials`` as the last ids,
    each a special token; ``template`` its chat template. Returns each special's id.

    Every id but the specials decodes to whole characters on its own: with the bytes past
    127 a dummy model's greedy loop may settle on half a UTF-8 character, which the server
    holds back, and its stream then sends no events to time. Text the runs send is ASCII."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = ascii_byte_tokens()
    if vocab_size < len(alphabet) + len(specials):
        raise ValueError(f"vocab_size {vocab_size} cannot hold the byte tokens and {len(specials)} specials")
    vocab = {token: i for i, token in enumerate(alphabet)}
    first_special = vocab_size - len(specials)
    for i in range(len(alphabet), first_special):
        vocab[_filler_token(i)] = i
    ids = {token: first_special + i for i, token in enumerate(specials)}
    vocab.update(ids)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)
    fast.chat_template = template
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return ids


def _template(turn: str, end: str, assistant: str, image: str = "") -> str:
    """A chat template: each message as ``turn`` (role substituted) + its text (an image part
    as ``image``) + ``end``; then ``assistant`` when a reply is asked for."""
    head = turn.replace("ROLE", "' + message.role + '")
    return ("{%- for message in messages %}{{- '" + head + "' }}"
            "{%- if message.content is string %}{{- message.content }}{%- else %}"
            "{%- for part in message.content %}{%- if part.type == 'image' %}{{- '" + image + "' }}"
            "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}"
            "{{- '" + end + "' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '" + assistant + "' }}{%- endif %}")


# --------------------------------------------------------------------------- the folders
def llama_dir(path: Path, smoke: bool) -> Path:
    """Llama-3.1-8B shapes (S1's), or S1's tiny ones: S1's ``config.json`` (bos and eos the
    last two ids), this module's tokenizer with the plain chat template."""
    from benchmarks.http_load import PLAIN_CHAT_TEMPLATE

    shapes = LLAMA_TINY if smoke else LLAMA_3_1_8B
    tiny_llama_dir(path, **shapes)
    write_tokenizer(path, shapes["vocab_size"], ["<|bos|>", "<|eos|>"], "<|eos|>", PLAIN_CHAT_TEMPLATE)
    return path


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]


def qwen3_8_dir(path: Path, smoke: bool, layers: int | None = None) -> Path:
    """Qwen3.8-27B in the multimodal layout (text and vision configs, processor settings)."""
    text = dict(QWEN_TINY_TEXT if smoke else QWEN3_8_27B_TEXT)
    if layers:
        text["num_hidden_layers"] = layers
    vision = dict(QWEN_TINY_VISION if smoke else QWEN3_8_27B_VISION, out_hidden_size=text["hidden_size"])
    ids = write_tokenizer(path, text["vocab_size"], QWEN_SPECIALS, "<|im_end|>", _template(
        "<|im_start|>ROLE\\n", "<|im_end|>\\n", "<|im_start|>assistant\\n",
        "<|vision_start|><|image_pad|><|vision_end|>"))
    text.update(model_type="qwen3_5_text", eos_token_id=ids["<|im_end|>"], rope_parameters=QWEN_TINY_ROPE if smoke
                else QWEN_ROPE, mamba_ssm_dtype="float32")
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "tie_word_embeddings": False, "text_config": text, "vision_config": vision,
              "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    patch, merge = vision["patch_size"], vision["spatial_merge_size"]
    side = patch * merge
    processor = {"patch_size": patch, "merge_size": merge, "temporal_patch_size": 2,
                 "size": {"shortest_edge": side * side * 4, "longest_edge": side * side * (1024 if not smoke else 16)}}
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    (path / "video_preprocessor_config.json").write_text(json.dumps(processor | {"fps": 2, "min_frames": 4,
                                                                                 "max_frames": 8}))
    return path


COMMAND_SPECIALS = ["<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>"]


def command_a_plus_dir(path: Path, smoke: bool, layers: int | None = None) -> Path:
    """Command A+'s decoder in the text-only layout (``Cohere2MoeForCausalLM``)."""
    config = dict(COMMAND_TINY if smoke else COMMAND_A_PLUS)
    if layers:
        config["num_hidden_layers"] = layers
    ids = write_tokenizer(path, config["vocab_size"], COMMAND_SPECIALS, "<|END_OF_TURN_TOKEN|>", _template(
        "<|START_OF_TURN_TOKEN|>ROLE: ", "<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>assistant: "))
    config.update(model_type="cohere2_moe", architectures=["Cohere2MoeForCausalLM"],
                  bos_token_id=ids["<BOS_TOKEN>"], eos_token_id=ids["<|END_OF_TURN_TOKEN|>"],
                  pad_token_id=ids["<|END_OF_TURN_TOKEN|>"])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<|user|>", "<|assistant|>"]


def glm52_dir(path: Path, smoke: bool, layers: int | None = None) -> Path:
    """GLM-5.2 in the released layout (``glm_moe_dsa``, fp8 ``quantization_config``, one MTP
    layer recorded; dummy weights never read them)."""
    config = dict(GLM_TINY if smoke else GLM_5_2)
    if layers:
        config["num_hidden_layers"] = layers
    ids = write_tokenizer(path, config["vocab_size"], GLM_SPECIALS, "<|endoftext|>",
                          "[gMASK]" + _template("<|ROLE|>", "", "<|assistant|>"))
    config.update(model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"], eos_token_id=ids["<|endoftext|>"],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_nextn_predict_layers=1,
                  quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# ------------------------------------------------------------------------- memory sizing
def decoder_layer_params(family: str, shapes: dict[str, Any]) -> tuple[int, int]:
    """(parameters of one decoder layer, those outside the layers: embeddings and head) at
    ``shapes``, counted from the matrices (norms and biases left out). For GLM-5.2 and
    Command A+ a layer is a MoE one (every expert held)."""
    h, v = shapes["hidden_size"], shapes["vocab_size"]
    outside = v * h * (1 if shapes.get("tie_word_embeddings") else 2)
    if family == "command_a_plus":
        d, kv = shapes["head_dim"], shapes["num_key_value_heads"]
        attention = 2 * h * shapes["num_attention_heads"] * d + 2 * h * kv * d
        experts = (shapes["num_experts"] + shapes["num_shared_experts"]) * 3 * h * shapes["intermediate_size"]
        return attention + experts + h * shapes["num_experts"], outside
    if family == "glm52":
        heads, q_rank, kv_rank = shapes["num_attention_heads"], shapes["q_lora_rank"], shapes["kv_lora_rank"]
        rope, nope, vdim = shapes["qk_rope_head_dim"], shapes["qk_nope_head_dim"], shapes["v_head_dim"]
        attention = (h * q_rank + q_rank * heads * (nope + rope) + h * (kv_rank + rope)
                     + kv_rank * heads * (nope + vdim) + heads * vdim * h)
        indexer = q_rank * shapes["index_n_heads"] * shapes["index_head_dim"] + h * shapes["index_head_dim"]
        experts = (shapes["n_routed_experts"] + shapes["n_shared_experts"]) * 3 * h * shapes["moe_intermediate_size"]
        return attention + indexer + experts + h * shapes["n_routed_experts"], outside
    raise ValueError(f"no layer count for {family!r}")


def layers_that_fit(family: str, shapes: dict[str, Any], tp: int, card_bytes: int, reserve_bytes: int,
                    dtype_bytes: int = 2) -> int:
    """The most decoder layers (at most the released count) whose weights, split over ``tp``
    ranks, fit one card's ``card_bytes`` less ``reserve_bytes`` (KV pool, activations, the
    CUDA context)."""
    layer, outside = decoder_layer_params(family, shapes)
    room = card_bytes - reserve_bytes - outside * dtype_bytes / tp
    return max(1, min(shapes["num_hidden_layers"], int(room // (layer * dtype_bytes / tp))))
