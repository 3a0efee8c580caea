"""Parity of Nemotron-H (Mamba-2 + attention without positions + relu^2 MLP) with
transformers' ``NemotronHForCausalLM`` on a tiny random config (fp32, CPU): logits at prefill
and every decode step of three requests of different lengths batched through the engine's
paged KV and state slots, prefills mixed with decodes; the config read from either layer-type
form; a checkpoint in the released ``backbone.*`` layout loads with coverage both ways."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import NemotronHConfig as HFConfig
from transformers import NemotronHForCausalLM as HFCausalLM

from mstar.engine.base import EngineItem
from mstar.model.nemotron_h import NemotronHConfig, NemotronHForCausalLM
from mstar.model.nemotron_h.checkpoint import NemotronHCheckpoint, load_checkpoint
from mstar.model.nemotron_h.engine import nemotron_h_engine
from mstar.model.weights import WeightLoadError

TOL = 1e-5
VOCAB = 160
PATTERN = "M*-M-*M"
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4,
            chunk_size=16, layer_norm_epsilon=1e-5, tie_word_embeddings=False, eos_token_id=2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(0.3 * noise if param.ndim == 1 else 0.15 * noise)
        if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            param.add_(1.0)


@pytest.fixture(scope="module")
def reference() -> HFCausalLM:
    model = HFCausalLM(HFConfig(hybrid_override_pattern=PATTERN, **TINY)).eval()
    _randomize(model, seed=0)
    return model


def _released(reference: HFCausalLM) -> dict[str, torch.Tensor]:
    """The reference's weights under the released names (``backbone.`` for ``model.``)."""
    return {("backbone." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
            for k, v in reference.state_dict().items()}


@pytest.fixture(scope="module")
def ours(reference: HFCausalLM) -> NemotronHForCausalLM:
    model = NemotronHForCausalLM(NemotronHConfig.from_hf_dict(reference.config.to_dict())).eval()
    load_checkpoint(model, _released(reference).items())
    return model


@contextmanager
def recording(model: NemotronHForCausalLM):
    """The logits of every step the model computes while inside, in order."""
    recorded: list[torch.Tensor] = []
    model.compute_logits = lambda h: recorded.append(NemotronHForCausalLM.compute_logits(model, h)) or recorded[-1]
    try:
        yield recorded
    finally:
        del model.compute_logits


def _engine(model: NemotronHForCausalLM, max_slots: int = 4):
    return nemotron_h_engine(model, max_slots=max_slots, state_dtype=torch.float32, num_pages=40, page_size=8,
                             max_seq_len=256, device=torch.device("cpu"), dtype=torch.float32)


def test_config_forms() -> None:
    from_pattern = NemotronHConfig.from_hf_dict(dict(TINY, hybrid_override_pattern=PATTERN))
    assert from_pattern.layer_types[:3] == ["linear_attention", "full_attention", "mlp"]
    assert from_pattern.attention_layers == [1, 5] and from_pattern.mamba_layers == [0, 3, 6]
    legacy = NemotronHConfig.from_hf_dict(dict(TINY, layers_block_type=["mamba", "attention", "mlp"],
                                               mamba_n_groups=4, mamba_d_conv=3, mamba_chunk_size=64))
    assert legacy.layer_types == ["linear_attention", "full_attention", "mlp"]
    assert (legacy.n_groups, legacy.conv_kernel, legacy.chunk_size) == (4, 3, 64)
    with pytest.raises(NotImplementedError, match="moe"):
        NemotronHConfig.from_hf_dict(dict(TINY, hybrid_override_pattern="M*E"))
    with pytest.raises(ValueError, match="layer types"):
        NemotronHConfig.from_hf_dict(TINY)


@torch.no_grad()
def test_batched_prefill_and_decode_match_transformers(reference: HFCausalLM, ours: NemotronHForCausalLM) -> None:
    """A (40 tokens: three scan chunks) and B prefill together; then B and A decode while C
    prefills; then all decode. Every step's logits match transformers on the whole sequence."""
    engine = _engine(ours)
    recorded: list[torch.Tensor] = []

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = NemotronHForCausalLM.compute_logits(ours, hidden)
        recorded.append(logits.clone())
        return logits

    ours.compute_logits = compute_logits
    try:
        gen = torch.Generator().manual_seed(5)
        prompts = {rid: torch.randint(0, VOCAB, (n,), generator=gen) for rid, n in (("a", 40), ("b", 5), ("c", 13))}
        params = {"sampling": {"temperature": 0.0}, "max_new_tokens": 100, "ignore_eos": True}
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

    worst = 0.0
    for rid, prompt in prompts.items():
        sequence = torch.cat((prompt, torch.tensor(tokens[rid][:-1])))
        ref = reference(sequence[None]).logits[0, len(prompt) - 1:]
        assert len(logits[rid]) == ref.shape[0]
        for i, row in enumerate(logits[rid]):
            err = rel_err(row, ref[i])
            worst = max(worst, err)
            assert err <= TOL, f"request {rid} step {i}: relative error {err:.2e}"
    print(f"worst relative logit error {worst:.2e}")

    for rid in prompts:
        engine.release(rid)
    assert engine.forward.states.num_used == 0 and engine.pool.num_used_pages == 0
    engine.forward.states.check_invariants()


@torch.no_grad()
def test_decode_matches_transformers_cache(reference: HFCausalLM, ours: NemotronHForCausalLM) -> None:
    """Decode steps against transformers' own cached decode (its recurrent step path)."""
    engine = _engine(ours)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(6))
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": 100, "ignore_eos": True}
    out = reference(prompt[None], use_cache=True)
    cache, token = out.cache, int(engine.run([EngineItem("x", "prefill", 0, {"prompt_ids": prompt}, params)])[0]
                                  .outputs["token"])
    assert token == int(out.logits[0, -1].argmax())
    with recording(ours) as recorded:
        for _ in range(4):
            out = reference(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = out.cache
            token = int(engine.run([EngineItem("x", "decode", 0, {"token": torch.tensor([token])}, params)])[0]
                        .outputs["token"])
            assert rel_err(recorded[-1][0], out.logits[0, -1]) <= TOL
    engine.release("x")


@torch.no_grad()
def test_input_embeds_replace_the_lookup(ours: NemotronHForCausalLM) -> None:
    """An item's ``input_embeds`` (the duplex model's fused frame) drive its step: embeds equal
    to the lookup give the same token, others change the logits of that row only."""
    params = {"sampling": {"temperature": 0.0}, "ignore_eos": True}
    prompt = torch.tensor([5, 6, 7, 8])
    with recording(ours) as recorded:
        engine = _engine(ours, max_slots=5)
        engine.run([EngineItem("a", "prefill", 0, {"prompt_ids": prompt}, params),
                    EngineItem("b", "prefill", 0, {"prompt_ids": prompt,
                                                   "input_embeds": ours.embed_input_ids(prompt)}, params)])
        assert torch.equal(recorded[-1][0], recorded[-1][1])
        other = torch.randn(4, ours.config.hidden_size, generator=torch.Generator().manual_seed(7))
        engine.run([EngineItem("c", "prefill", 0, {"prompt_ids": prompt, "input_embeds": other}, params)])
        assert not torch.allclose(recorded[-1][0], recorded[0][0])
        with pytest.raises(ValueError, match="input_embeds"):
            engine.run([EngineItem("d", "prefill", 0, {"prompt_ids": prompt, "input_embeds": other[:2]}, params)])
        assert not engine.forward.states.has("d")  # refused before its forward: its slot is back


@torch.no_grad()
def test_decode_graphs_equal_eager(ours: NemotronHForCausalLM) -> None:
    """Token decodes through the decode graphs (run eagerly on the CPU over the same buckets
    and padding): three sequences in bucket 4, one padded row on the sink slot, then two; every
    step's logits as eager's, a later joiner's one-token first step through a bucket too."""
    params = {"sampling": {"temperature": 0.0}, "ignore_eos": True}
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 12], "c": list(range(20, 40))}
    logits = []
    for graphs in (False, True):
        extra = {"cuda_graphs": True, "graph_batch_sizes": (1, 4)} if graphs else {}
        engine = nemotron_h_engine(ours, max_slots=5, state_dtype=torch.float32, num_pages=40, page_size=8,
                                   max_seq_len=256, device=torch.device("cpu"), dtype=torch.float32, **extra)
        with recording(ours) as recorded:
            last = {r: o.outputs["token"] for r, o in zip(prompts, engine.run(
                [EngineItem(r, "prefill", 0, {"prompt_ids": torch.tensor(p)}, params) for r, p in prompts.items()]))}
            for step in range(4):
                if step == 2:
                    engine.release("b")
                    del last["b"]
                    last |= {"d": engine.run([EngineItem("d", "prefill", 0, {"prompt_ids": torch.tensor([3])},
                                                         params)])[0].outputs["token"]}
                outs = engine.run([EngineItem(r, "decode", 0, {"token": t}, params) for r, t in last.items()])
                last = {r: o.outputs["token"] for r, o in zip(last, outs)}
        logits.append(recorded)
        if graphs:
            assert engine.graphs.captured_batch_sizes == (1, 4)
    assert len(logits[0]) == len(logits[1])
    for x, y in zip(*logits):  # a graph computes its bucket's rows: the batch's come first
        assert y.shape[0] in (x.shape[0], 4) and rel_err(y[:x.shape[0]], x) <= TOL


@torch.no_grad()
def test_failed_step_frees_fresh_slots_and_poisons_advanced_ones(ours: NemotronHForCausalLM) -> None:
    engine = _engine(ours, max_slots=3)
    params = {"sampling": {"temperature": 0.0}}
    token = engine.run([EngineItem("a", "prefill", 0, {"prompt_ids": torch.tensor([1, 2, 3])}, params)])[0] \
        .outputs["token"]

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    ours.forward = broken
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.run([EngineItem("a", "decode", 0, {"token": token}, params),
                        EngineItem("b", "prefill", 0, {"prompt_ids": torch.tensor([4, 5])}, params)])
    finally:
        del ours.forward
    assert not engine.forward.states.has("b") and engine.forward.states.has("a")
    with pytest.raises(RuntimeError, match="recurrent state was lost"):
        engine.run([EngineItem("a", "decode", 0, {"token": token}, params)])
    engine.release("a")
    assert engine.forward.states.num_used == 0 and engine.pool.num_used_pages == 0


# ------------------------------------------------------ the released key layout
@pytest.fixture(scope="module")
def released(reference: HFCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("nemotron_h_ckpt")
    save_file(_released(reference), directory / "model.safetensors")
    config = dict(TINY, hybrid_override_pattern=PATTERN, architectures=["NemotronHForCausalLM"],
                  model_type="nemotron_h")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@torch.no_grad()
def test_released_checkpoint_loads_and_matches(reference: HFCausalLM, released: Path) -> None:
    ckpt = NemotronHCheckpoint.locate(str(released))
    model = ckpt.load_model(torch.device("cpu"), torch.float32)
    assert any(name.startswith("backbone.layers.0.mixer.A_log") for name, _ in ckpt.tensors())
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(9))
    with recording(model) as recorded:
        _engine(model).run([EngineItem("x", "prefill", 0, {"prompt_ids": prompt}, {"sampling": {"temperature": 0.0}})])
    assert rel_err(recorded[0][0], reference(prompt[None]).logits[0, -1]) <= TOL


def test_released_checkpoint_coverage_both_ways(released: Path) -> None:
    ckpt = NemotronHCheckpoint.locate(str(released))
    tensors = dict(ckpt.tensors())
    model = NemotronHForCausalLM(ckpt.config())
    missing = {k: v for k, v in tensors.items() if k != "backbone.layers.3.mixer.D"}
    with pytest.raises(WeightLoadError, match=r"did not fill .*backbone\.layers\.3\.mixer\.D"):
        load_checkpoint(model, missing.items())
    extra = dict(tensors, **{"backbone.layers.9.mixer.up_proj.weight": torch.zeros(1)})
    with pytest.raises(WeightLoadError, match=r"nothing loads .*layers\.9\.mixer\.up_proj"):
        load_checkpoint(model, extra.items())
    skipped = dict(tensors, **{"mtp.layers.0.norm.weight": torch.zeros(1)})  # multi-token prediction: skipped
    load_checkpoint(model, skipped.items())


def test_dummy_weights_are_seeded(released: Path) -> None:
    ckpt = NemotronHCheckpoint.locate(str(released))
    a = ckpt.load_model(torch.device("cpu"), torch.float32, dummy=True, seed=3)
    b = ckpt.load_model(torch.device("cpu"), torch.float32, dummy=True, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.backbone.layers[0].mixer.norm.weight.eq(1).all()


def test_release_dimensions() -> None:
    """NVIDIA-Nemotron-Nano-9B-v2, the duplex model's LLM (its config.json values), built on the
    meta device: 27 Mamba-2, 4 attention and 25 MLP layers, and a state slot of ~139 MiB in
    fp32 (the reference's ~137 MB)."""
    config = NemotronHConfig.from_hf_dict({
        "vocab_size": 131072, "hidden_size": 4480, "intermediate_size": 15680, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 80, "n_groups": 8,
        "ssm_state_size": 128, "conv_kernel": 4, "rms_norm_eps": 1e-5, "time_step_limit": [0.0, float("inf")],
        "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"})
    assert (len(config.mamba_layers), len(config.attention_layers), config.layer_types.count("mlp")) == (27, 4, 25)
    with torch.device("meta"):
        model = NemotronHForCausalLM(config)
    shapes = model.state_shapes()
    assert shapes == {"conv": (3, 128 * 80 + 2 * 8 * 128), "ssm": (128, 80, 128)}
    per_slot = 27 * sum(torch.Size(shape).numel() for shape in shapes.values()) * 4
    assert 138 < per_slot / 2**20 < 140
    assert model.cache_shape() == (4, 8, 128)


@torch.no_grad()
def test_bf16_engine_keeps_fp32_ssm_states(ours: NemotronHForCausalLM) -> None:
    """The served dtype: bf16 weights and conv windows, float32 SSM states; the greedy
    logits stay near the fp32 model's over a prefill and decodes."""
    import copy

    half = copy.deepcopy(ours).to(torch.bfloat16)
    engines = {torch.float32: _engine(ours), torch.bfloat16: nemotron_h_engine(
        half, max_slots=4, state_dtype=torch.float32, num_pages=40, page_size=8, max_seq_len=256,
        device=torch.device("cpu"), dtype=torch.bfloat16)}
    assert engines[torch.bfloat16].forward.ssm_states[0].dtype == torch.float32
    assert engines[torch.bfloat16].forward.conv_states[0].dtype == torch.bfloat16
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(11))
    params = {"sampling": {"temperature": 0.0}, "ignore_eos": True}
    logits, tokens = {}, {}
    for dtype, engine in engines.items():
        model = half if dtype == torch.bfloat16 else ours
        with recording(model) as recorded:
            sampled = [int(engine.run([EngineItem("x", "prefill", 0, {"prompt_ids": prompt}, params)])[0]
                           .outputs["token"])]
            for _ in range(3):
                item = EngineItem("x", "decode", 0, {"token": torch.tensor([sampled[-1]])}, params)
                sampled.append(int(engine.run([item])[0].outputs["token"]))
        logits[dtype], tokens[dtype] = torch.stack([row[0] for row in recorded]), sampled
    same = next((i for i, (a, b) in enumerate(zip(*tokens.values())) if a != b), len(tokens[torch.float32]))
    # rows up to the first differing token had the same inputs
    assert rel_err(logits[torch.bfloat16][:same + 1], logits[torch.float32][:same + 1]) <= 5e-2
