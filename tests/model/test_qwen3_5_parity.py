"""Parity of the Qwen3.5 hybrid model (gated DeltaNet + gated attention) with transformers
on a tiny random config (fp32, CPU): logits at prefill and at every decode step of three
requests batched through the engine's paged KV and state slots, prefills mixed with
decodes; and loading a checkpoint in the released (multimodal) key layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5Config as HFConfig
from transformers import Qwen3_5ForCausalLM as HFCausalLM
from transformers import Qwen3_5ForConditionalGeneration as HFConditional
from transformers import Qwen3_5TextConfig as HFTextConfig

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.layers.rotary import MRotaryEmbedding
from mstar.model.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from mstar.model.qwen3_5.checkpoint import Qwen3_5Checkpoint, load_checkpoint
from mstar.model.qwen3_5.engine import hybrid_engine
from mstar.model.weights import WeightLoadError

TOL = 1e-4
VOCAB = 160
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, layer_types=LAYER_TYPES, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(0.3 * noise if param.ndim == 1 else 0.1 * noise)
        if name.endswith("linear_attn.norm.weight"):
            param.add_(1.0)


@pytest.fixture(scope="module")
def reference() -> HFCausalLM:
    model = HFCausalLM(HFTextConfig(**TEXT)).eval()
    _randomize(model, seed=0)
    return model


@pytest.fixture(scope="module")
def ours(reference: HFCausalLM) -> Qwen3_5ForCausalLM:
    model = Qwen3_5ForCausalLM(Qwen3_5Config.from_hf_dict(reference.config.to_dict())).eval()
    load_checkpoint(model, reference.state_dict().items())
    return model


def _engine(model: Qwen3_5ForCausalLM, max_slots: int = 4) -> AutoregressiveEngine:
    config = model.config
    return hybrid_engine(model, KVLayout(len(config.full_layers), config.num_key_value_heads, config.head_dim),
                         num_state_layers=len(config.linear_layers), state_shapes=model.state_shapes(),
                         max_slots=max_slots, state_dtype=torch.float32, num_pages=40, page_size=8,
                         max_seq_len=256, device=torch.device("cpu"), dtype=torch.float32)


def test_config_reads_nested_text_config() -> None:
    nested = {"model_type": "qwen3_5", "tie_word_embeddings": True,
              "text_config": dict(TEXT, tie_word_embeddings=False, eos_token_id=7, mamba_ssm_dtype="float32")}
    config = Qwen3_5Config.from_hf_dict(nested)
    assert config.tie_word_embeddings  # the top-level key is the one the checkpoint follows
    assert config.layer_types == LAYER_TYPES and config.full_layers == [1, 3]
    assert (config.rotary_dim, config.mrope_section, config.eos_token_id) == (8, [2, 1, 1], 7)
    assert config.mamba_ssm_dtype == "float32"
    default = Qwen3_5Config.from_hf_dict({k: v for k, v in TEXT.items() if k not in ("layer_types", "rope_parameters")}
                                         | {"num_hidden_layers": 8})
    assert default.full_layers == [3, 7] and default.rotary_dim == 4


def test_mrope_matches_transformers(reference: HFCausalLM) -> None:
    """Distinct temporal/height/width positions (as vision tokens will have)."""
    positions = torch.stack([torch.arange(6), torch.arange(6) * 2 + 1, torch.arange(6) * 3 + 2])
    ref_cos, ref_sin = reference.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    rope = MRotaryEmbedding(8, 10000.0, [2, 1, 1])
    cos, sin = rope.cos_sin(positions, torch.float32)
    assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)


@torch.no_grad()
def test_batched_prefill_and_decode_match_transformers(reference: HFCausalLM, ours: Qwen3_5ForCausalLM) -> None:
    """A (70 tokens: two DeltaNet chunks) and B prefill together; then B and A decode while
    C prefills; then all decode. Every step's logits match transformers on the whole sequence."""
    engine = _engine(ours)
    recorded: list[torch.Tensor] = []

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = Qwen3_5ForCausalLM.compute_logits(ours, hidden)
        recorded.append(logits.clone())
        return logits

    ours.compute_logits = compute_logits
    try:
        gen = torch.Generator().manual_seed(5)
        prompts = {rid: torch.randint(0, VOCAB, (n,), generator=gen) for rid, n in (("a", 70), ("b", 5), ("c", 13))}
        params = {"sampling": {"temperature": 0.0}, "max_new_tokens": 100}
        tokens = {rid: [] for rid in prompts}
        logits = {rid: [] for rid in prompts}

        def step(requests: list[str]) -> None:
            items = []
            for rid in requests:
                if tokens[rid]:
                    items.append(EngineItem(rid, "decode", 0, {"token": torch.tensor([tokens[rid][-1]])}, params))
                else:
                    items.append(EngineItem(rid, "prefill", 0, {"prompt_ids": prompts[rid]}, params))
            outputs = engine.run(items)
            for rid, out, row in zip(requests, outputs, recorded[-1]):
                tokens[rid].append(int(out.outputs["token"]))
                logits[rid].append(row)

        step(["a", "b"])
        step(["b", "a", "c"])
        for _ in range(5):
            step(["a", "b", "c"])
        assert engine.forward.states.num_used == 3
        engine.forward.states.check_invariants()
    finally:
        del ours.compute_logits

    for rid, prompt in prompts.items():
        sequence = torch.cat((prompt, torch.tensor(tokens[rid][:-1])))
        ref = reference(sequence[None]).logits[0, len(prompt) - 1:]
        assert len(logits[rid]) == ref.shape[0]
        for i, row in enumerate(logits[rid]):
            err = rel_err(row, ref[i])
            assert err <= TOL, f"request {rid} step {i}: relative error {err:.2e}"

    for rid in prompts:
        engine.release(rid)
    assert engine.forward.states.num_used == 0 and engine.pool.num_used_pages == 0
    engine.forward.states.check_invariants()


@torch.no_grad()
def test_failed_step_frees_fresh_slots_and_poisons_advanced_ones(ours: Qwen3_5ForCausalLM) -> None:
    engine = _engine(ours, max_slots=3)
    params = {"sampling": {"temperature": 0.0}}
    first = engine.run([EngineItem("a", "prefill", 0, {"prompt_ids": torch.tensor([1, 2, 3])}, params)])
    token = first[0].outputs["token"]

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    ours.forward = broken
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.run([EngineItem("a", "decode", 0, {"token": token}, params),
                        EngineItem("b", "prefill", 0, {"prompt_ids": torch.tensor([4, 5])}, params)])
    finally:
        del ours.forward
    assert not engine.forward.states.has("b") and engine.forward.states.has("a")  # fresh b gave its slot back
    with pytest.raises(RuntimeError, match="recurrent state was lost"):
        engine.run([EngineItem("a", "decode", 0, {"token": token}, params)])
    engine.release("a")
    assert engine.forward.states.num_used == 0 and engine.pool.num_used_pages == 0


def test_third_request_waits_for_a_slot(ours: Qwen3_5ForCausalLM) -> None:
    from mstar.engine.state_pool import OutOfSlots

    engine = _engine(ours, max_slots=2)  # one slot plus the sink
    params = {"sampling": {"temperature": 0.0}}
    engine.run([EngineItem("a", "prefill", 0, {"prompt_ids": torch.tensor([1, 2])}, params)])
    with pytest.raises(OutOfSlots):
        engine.run([EngineItem("b", "prefill", 0, {"prompt_ids": torch.tensor([3])}, params)])
    assert not engine.pool.has("b") and "b" not in engine.seqs


# ------------------------------------------------------ the released key layout
def _tiny_multimodal() -> HFConditional:
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    config = HFConfig(text_config=dict(TEXT), vision_config=vision, tie_word_embeddings=False)
    model = HFConditional(config).eval()
    _randomize(model, seed=3)
    return model


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> tuple[HFConditional, Path]:
    model = _tiny_multimodal()
    directory = tmp_path_factory.mktemp("qwen3_5_ckpt")
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.randn(64, 128)  # the MTP head the release ships and we skip
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(model.config.to_dict()))
    return model, directory


def test_released_layout_keys() -> None:
    names = list(_tiny_multimodal().state_dict())
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    assert any(n.startswith("model.visual.") for n in names) and "lm_head.weight" in names


@torch.no_grad()
def test_released_checkpoint_loads_and_matches(released: tuple[HFConditional, Path]) -> None:
    reference, directory = released
    ckpt = Qwen3_5Checkpoint.locate(str(directory))
    model = Qwen3_5ForCausalLM(ckpt.config()).eval()
    load_checkpoint(model, ckpt.tensors())
    engine = _engine(model)
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(9))
    hidden = []
    original = model.compute_logits
    model.compute_logits = lambda h: hidden.append(original(h)) or hidden[-1]
    try:
        engine.run([EngineItem("x", "prefill", 0, {"prompt_ids": prompt}, {"sampling": {"temperature": 0.0}})])
    finally:
        del model.compute_logits
    ref = reference(input_ids=prompt[None]).logits[0, -1]
    assert rel_err(hidden[0][0], ref) <= TOL


def test_released_checkpoint_coverage_both_ways(released: tuple[HFConditional, Path]) -> None:
    _, directory = released
    ckpt = Qwen3_5Checkpoint.locate(str(directory))
    tensors = dict(ckpt.tensors())
    model = Qwen3_5ForCausalLM(ckpt.config())
    missing = {k: v for k, v in tensors.items() if k != "model.language_model.layers.0.linear_attn.A_log"}
    with pytest.raises(WeightLoadError, match=r"did not fill .*model\.layers\.0\.linear_attn\.A_log"):
        load_checkpoint(model, missing.items())
    extra = dict(tensors, **{"model.language_model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(WeightLoadError, match=r"nothing loads .*layers\.9\.mlp\.up_proj"):
        load_checkpoint(model, extra.items())


def test_tied_checkpoint_without_head() -> None:
    config = Qwen3_5Config.from_hf_dict(dict(TEXT, tie_word_embeddings=True))
    source = Qwen3_5ForCausalLM(config)
    tensors = {("model.language_model." + k[len("model."):]): v for k, v in source.state_dict().items()}
    model = Qwen3_5ForCausalLM(config)
    load_checkpoint(model, tensors.items())
    assert not hasattr(model, "lm_head")
    assert torch.equal(model.output_weight, source.model.embed_tokens.weight)


@torch.no_grad()
def test_request_refused_before_forward_costs_nobody(ours: Qwen3_5ForCausalLM) -> None:
    """A bad item fails its batch before the forward pass: the others' states stay usable."""
    engine = _engine(ours)
    params = {"sampling": {"temperature": 0.0}}
    first = engine.run([EngineItem("a", "prefill", 0, {"prompt_ids": torch.tensor([1, 2, 3])}, params),
                        EngineItem("b", "prefill", 0, {"prompt_ids": torch.tensor([4, 5])}, params)])
    token_a, token_b = (out.outputs["token"] for out in first)
    with pytest.raises(RuntimeError, match="does not follow its history"):
        engine.run([EngineItem("a", "decode", 0, {"token": token_a}, params),
                    EngineItem("b", "decode", 0, {"token": (token_b + 1) % VOCAB}, params)])
    assert not engine.forward.lost
    engine.run([EngineItem("a", "decode", 0, {"token": token_a}, params)])
