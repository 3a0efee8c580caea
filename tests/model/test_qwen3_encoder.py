"""Parity of the Qwen3 text encoder (and the klein / Z-Image prompt conditioning) against
transformers' Qwen3 and diffusers' pipelines, on a tiny random model and a local tokenizer."""

from __future__ import annotations

import pytest
import torch
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer
from transformers import Qwen3Config as HFQwen3Config
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM
from transformers import Qwen3Model as HFQwen3Model

from mstar.model.qwen3 import (
    Qwen3Config,
    Qwen3TextEncoder,
    klein_prompt_embeds,
    z_image_caption_embeds,
)
from mstar.model.weights import load_weights

TOL = 1e-5
NUM_LAYERS = 4
MAX_LENGTH = 24
PROMPTS = ["a cat holding a sign", "hi"]
LONG_PROMPT = "a very long prompt about a cat and a castle " * 4  # truncated at MAX_LENGTH

# Qwen3's chat template, reduced to what the pipelines use (one user turn + generation prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = rel_err(ours, ref)
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


@pytest.fixture(scope="module")
def tokenizer() -> Qwen2Tokenizer:
    return make_qwen_tokenizer()


def make_qwen_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE Qwen2 tokenizer: the 256 byte symbols, Qwen's special tokens, a few
    merges; pads on the right with ``<|endoftext|>`` like the real one."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    merges = [("Ġ", "c"), ("a", "t"), ("Ġc", "at"), ("Ġ", "a")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_tokens(specials[1:], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _hf_config(vocab_size: int) -> HFQwen3Config:
    return HFQwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with non-trivial norm scales (so a missed q_norm/k_norm shows)."""
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(1.0 + 0.2 * noise if param.ndim == 1 else 0.08 * noise)


@pytest.fixture(scope="module")
def hf_model(tokenizer: Qwen2Tokenizer) -> HFQwen3Model:
    model = HFQwen3Model(_hf_config(len(tokenizer))).eval()
    _randomize(model, seed=0)
    return model


@pytest.fixture(scope="module")
def hf_causal_lm(tokenizer: Qwen2Tokenizer) -> HFQwen3ForCausalLM:
    model = HFQwen3ForCausalLM(_hf_config(len(tokenizer))).eval()
    _randomize(model, seed=1)
    return model


def _config(hf: torch.nn.Module) -> Qwen3Config:
    return Qwen3Config.from_hf_dict(hf.config.to_dict())


def _encoder(hf: torch.nn.Module, taps: tuple[int, ...]) -> Qwen3TextEncoder:
    encoder = Qwen3TextEncoder(_config(hf), tap_layers=taps).eval()
    load_weights(encoder, hf.state_dict().items(), name_map=encoder.checkpoint_name_map)
    return encoder


def test_config_from_hf_dict(hf_model: HFQwen3Model) -> None:
    config = _config(hf_model)
    assert (config.num_hidden_layers, config.num_kv_heads, config.head_dim) == (NUM_LAYERS, 2, 16)
    assert config.rope_theta == 1_000_000.0 and config.rope_scaling is None
    assert Qwen3Config.from_hf_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("taps", [(1, 2, 3), (0, -2, NUM_LAYERS)])
def test_hidden_states_match_transformers(
    tokenizer: Qwen2Tokenizer, hf_model: HFQwen3Model, padding_side: str, taps: tuple[int, ...]
) -> None:
    encoder = _encoder(hf_model, taps)
    assert len(encoder.model.layers) == max(encoder.tap_layers)
    assert (encoder.model.norm is not None) == (NUM_LAYERS in encoder.tap_layers)

    batch = tokenizer(PROMPTS, padding="longest", padding_side=padding_side, return_tensors="pt")
    assert batch["attention_mask"].sum(1).tolist()[1] < batch["input_ids"].shape[1]
    with torch.no_grad():
        ref = hf_model(**batch, output_hidden_states=True).hidden_states
        ours = encoder(batch["input_ids"], batch["attention_mask"])
    assert len(ours) == len(taps)
    for tap, state in zip(taps, ours):
        check(f"hidden_states[{tap}] ({padding_side} padding)", state, ref[tap])


def test_truncated_stack_keys(hf_causal_lm: HFQwen3ForCausalLM) -> None:
    encoder = _encoder(hf_causal_lm, (1, 2, 3))  # strict load: coverage checked both ways
    keys = encoder.expected_keys()
    assert "model.embed_tokens.weight" in keys
    assert "model.layers.2.self_attn.q_norm.weight" in keys
    assert "model.layers.2.self_attn.k_norm.weight" in keys
    assert not any(k.startswith(("model.layers.3.", "lm_head.", "model.norm.")) for k in keys)
    ckpt = set(hf_causal_lm.state_dict())
    used = {encoder.checkpoint_name_map(k) for k in ckpt} - {None}
    assert used == keys
    skipped = {k for k in ckpt if encoder.checkpoint_name_map(k) is None}
    untapped = ("model.layers.3.", "lm_head.", "model.norm.")
    assert skipped == {k for k in ckpt if k.startswith(untapped)}
    # Bare Qwen3Model keys get the prefix; layers the config does not have are not hidden.
    bare = "layers.0.mlp.up_proj.weight"
    assert encoder.checkpoint_name_map(bare) == f"model.{bare}"
    assert encoder.checkpoint_name_map("model.layers.9.mlp.up_proj.weight") is not None
    with pytest.raises(ValueError):
        encoder(torch.zeros(1, 4, dtype=torch.long), tap_layers=(NUM_LAYERS,))


def test_klein_prompt_embeds_match_pipeline(
    tokenizer: Qwen2Tokenizer, hf_causal_lm: HFQwen3ForCausalLM
) -> None:
    from diffusers import Flux2KleinPipeline

    taps = (1, 2, 3)
    pipe = Flux2KleinPipeline(
        scheduler=None, vae=None, text_encoder=hf_causal_lm, tokenizer=tokenizer, transformer=None
    )
    prompts = [*PROMPTS, LONG_PROMPT]
    ref_embeds, ref_ids = pipe.encode_prompt(
        list(prompts),
        device=torch.device("cpu"),
        num_images_per_prompt=2,
        max_sequence_length=MAX_LENGTH,
        text_encoder_out_layers=taps,
    )
    encoder = _encoder(hf_causal_lm, taps)
    assert len(encoder.model.layers) == 3
    embeds, ids = klein_prompt_embeds(
        encoder, tokenizer, prompts, max_length=MAX_LENGTH, tap_layers=taps, num_images_per_prompt=2
    )
    assert embeds.shape == (2 * len(prompts), MAX_LENGTH, 3 * 64)
    check("klein prompt_embeds", embeds, ref_embeds)
    assert ids.dtype == ref_ids.dtype and torch.equal(ids, ref_ids)


def test_z_image_caption_embeds_match_pipeline(
    tokenizer: Qwen2Tokenizer, hf_model: HFQwen3Model
) -> None:
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline(
        scheduler=None, vae=None, text_encoder=hf_model, tokenizer=tokenizer, transformer=None
    )
    prompts = [*PROMPTS, LONG_PROMPT]
    # _encode_prompt rewrites its list argument in place: hand it a copy.
    ref = pipe._encode_prompt(
        list(prompts), device=torch.device("cpu"), max_sequence_length=MAX_LENGTH
    )
    encoder = _encoder(hf_model, (-2,))
    assert len(encoder.model.layers) == NUM_LAYERS - 1
    ours = z_image_caption_embeds(encoder, tokenizer, prompts, max_length=MAX_LENGTH)
    assert len(ours) == len(ref) == len(prompts)
    for i, (mine, theirs) in enumerate(zip(ours, ref)):
        check(f"z-image caption {i}", mine, theirs)
    assert ours[-1].shape[0] == MAX_LENGTH
