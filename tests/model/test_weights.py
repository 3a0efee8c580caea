"""Tests of mstar.model.weights on tiny random transformers Llama checkpoints."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn

from mstar.model.weights import (
    ModelPathError,
    WeightLoadError,
    init_dummy_weights,
    iter_safetensors,
    load_weights,
    resolve_model_path,
)

REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tiny_llama(seed: int, tied: bool = False) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def logits(model: nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 17, 42, 3, 88]])
    with torch.no_grad():
        return model(ids).logits


def save_to_hub_cache(model: nn.Module, cache: Path, **save_kwargs) -> None:
    """Lay ``model`` out as a hub cache snapshot of ``REPO_ID`` at ``COMMIT`` under ``cache``."""
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    model.save_pretrained(repo / "snapshots" / COMMIT, **save_kwargs)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def source() -> transformers.LlamaForCausalLM:
    return tiny_llama(seed=0)


@pytest.fixture
def checkpoint(tmp_path: Path, source: nn.Module) -> Path:
    """A single-file safetensors checkpoint of ``source``."""
    path = tmp_path / "ckpt"
    source.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return path


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_hub_cache_round_trip(tmp_path: Path, source, offline, sharded: bool) -> None:
    cache = tmp_path / "hub"
    save_to_hub_cache(source, cache, **({"max_shard_size": "20KB"} if sharded else {}))
    path = resolve_model_path(REPO_ID, cache_dir=cache)
    assert path == cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert (path / "model.safetensors.index.json").is_file() == sharded
    if sharded:
        assert len(list(path.glob("*.safetensors"))) > 1

    target = tiny_llama(seed=1)
    assert not torch.equal(logits(target), logits(source))
    load_weights(target, iter_safetensors(path))
    assert torch.equal(logits(target), logits(source))


def test_resolve_local_directory_as_is(checkpoint: Path) -> None:
    assert resolve_model_path(str(checkpoint)) == checkpoint


def test_resolve_unknown_repo_offline_names_it(tmp_path: Path, offline) -> None:
    with pytest.raises(ModelPathError, match="nobody/nothing"):
        resolve_model_path("nobody/nothing", cache_dir=tmp_path, allow_patterns=["*.json"])


def test_resolve_missing_local_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "does" / "not" / "exist"
    with pytest.raises(ModelPathError, match="does/not/exist"):
        resolve_model_path(str(missing))


def test_iter_safetensors_without_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        list(iter_safetensors(tmp_path))


def test_iter_safetensors_any_file_without_index(tmp_path: Path, source) -> None:
    state = source.state_dict()
    names = sorted(state)
    save_file({k: state[k].contiguous() for k in names[:5]}, tmp_path / "a.safetensors")
    save_file({k: state[k].contiguous() for k in names[5:]}, tmp_path / "b.safetensors")
    target = tiny_llama(seed=1)
    load_weights(target, iter_safetensors(tmp_path))
    assert torch.equal(logits(target), logits(source))


def write_state(path: Path, state: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    return path


def test_missing_tensor_is_named(tmp_path: Path, source) -> None:
    state = dict(source.state_dict())
    del state["model.layers.1.mlp.down_proj.weight"]
    ckpt = write_state(tmp_path / "missing", state)
    expected = r"did not fill \(1: model\.layers\.1\.mlp\.down_proj\.weight\)"
    with pytest.raises(WeightLoadError, match=expected):
        load_weights(tiny_llama(seed=1), iter_safetensors(ckpt))


def test_extra_tensor_is_named(tmp_path: Path, source) -> None:
    state = dict(source.state_dict())
    state["model.layers.7.mlp.surprise.weight"] = torch.zeros(3)
    ckpt = write_state(tmp_path / "extra", state)
    expected = r"nothing loads \(1: model\.layers\.7\.mlp\.surprise\.weight\)"
    with pytest.raises(WeightLoadError, match=expected):
        load_weights(tiny_llama(seed=1), iter_safetensors(ckpt))
    # Non-strict loading accepts it and still fills everything else.
    target = tiny_llama(seed=1)
    load_weights(target, iter_safetensors(ckpt), strict=False)
    assert torch.equal(logits(target), logits(source))


def test_wrong_shape_names_tensor_and_shapes(tmp_path: Path, source) -> None:
    state = dict(source.state_dict())
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    ckpt = write_state(tmp_path / "shape", state)
    with pytest.raises(WeightLoadError) as info:
        load_weights(tiny_llama(seed=1), iter_safetensors(ckpt))
    message = str(info.value)
    assert "model.layers.0.self_attn.k_proj.weight" in message
    assert "(8, 32)" in message and "(16, 32)" in message


def test_name_map_renames_and_skips(source) -> None:
    state = {f"backbone.{k}": v for k, v in source.state_dict().items()}
    state["backbone.rotary.inv_freq"] = torch.ones(4)

    def strip(name: str) -> str | None:
        return None if name.endswith("inv_freq") else name.removeprefix("backbone.")

    target = tiny_llama(seed=1)
    load_weights(target, state.items(), name_map=strip)
    assert torch.equal(logits(target), logits(source))


def test_tied_embeddings_need_no_lm_head(tmp_path: Path) -> None:
    source = tiny_llama(seed=0, tied=True)
    source.save_pretrained(tmp_path / "tied")
    names = [name for name, _ in iter_safetensors(tmp_path / "tied")]
    assert "lm_head.weight" not in names
    target = tiny_llama(seed=1, tied=True)
    load_weights(target, iter_safetensors(tmp_path / "tied"))
    assert torch.equal(logits(target), logits(source))
    # A checkpoint that also spells out the tied alias loads too.
    load_weights(tiny_llama(seed=2, tied=True), source.state_dict().items())


def test_dtype_cast_and_persistent_buffers() -> None:
    class WithBuffers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 2, bias=False).to(torch.bfloat16)
            self.register_buffer("scale", torch.zeros(2))
            self.register_buffer("cache", torch.zeros(3), persistent=False)

    module = WithBuffers()
    weight = torch.randn(2, 4, dtype=torch.float64)
    load_weights(module, [("proj.weight", weight), ("scale", torch.ones(2))])
    assert module.proj.weight.dtype == torch.bfloat16
    assert torch.equal(module.proj.weight, weight.to(torch.bfloat16))
    assert torch.equal(module.scale, torch.ones(2))
    with pytest.raises(WeightLoadError, match=r"did not fill \(1: scale\)"):
        load_weights(WithBuffers(), [("proj.weight", weight)])


def test_weight_loader_hook_replaces_copy() -> None:
    module = nn.Linear(4, 4, bias=False)
    calls: list[tuple[nn.Parameter, torch.Tensor]] = []

    def take_first_half(param: nn.Parameter, full: torch.Tensor) -> None:
        calls.append((param, full))
        param.data.zero_()[:2].copy_(full[:2])

    module.weight.weight_loader = take_first_half  # type: ignore[attr-defined]
    full = torch.randn(8, 4)  # a full tensor of which this rank keeps a shard
    load_weights(module, [("weight", full)])
    assert len(calls) == 1 and calls[0][0] is module.weight
    assert torch.equal(module.weight[:2], full[:2])


def test_dummy_init_is_deterministic() -> None:
    a, b = tiny_llama(seed=1), tiny_llama(seed=2)
    init_dummy_weights(a, seed=0)
    init_dummy_weights(b, seed=0)
    state_a, state_b = a.state_dict(), b.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert torch.equal(logits(a), logits(b))
    assert torch.equal(a.model.norm.weight, torch.ones(32))
    std = a.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025
    c = tiny_llama(seed=1)
    init_dummy_weights(c, seed=1)
    assert not torch.equal(c.model.embed_tokens.weight, a.model.embed_tokens.weight)


def _mixed(dtype: torch.dtype) -> nn.Module:
    """Matrices of multiples of 16 elements, one of 37 x 33 (not), a strided parameter,
    a norm weight and a bias, in ``dtype``."""
    module = nn.ModuleDict({"proj": nn.Linear(64, 32), "norm": nn.LayerNorm(32), "up": nn.Linear(32, 48),
                            "odd": nn.Linear(33, 37)})
    module.register_parameter("strided", nn.Parameter(torch.empty(24, 40).t()))
    return module.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dummy_weights_are_drawn_in_the_parameters_dtype(dtype: torch.dtype) -> None:
    """A 16-bit module's dummy draw allocates nothing (no float32 temporary, no cast copy),
    keeps the float32 draw's rules (each value is the float32 draw's, rounded, while every
    size so far was a multiple of 16; ones and zeros for norms and biases) and is the same for
    the same seed."""
    from torch.profiler import ProfilerActivity, profile

    drawn, plain = _mixed(dtype), _mixed(torch.float32)
    del drawn.strided  # the strided view is the one parameter that needs a temporary
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        init_dummy_weights(drawn, seed=3)
    assert [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0] == []
    del plain.strided
    init_dummy_weights(plain, seed=3)
    assert {p.dtype for p in drawn.parameters()} == {dtype}
    for name in ("proj.weight", "up.weight"):  # sizes multiples of 16: the same stream as float32
        assert torch.equal(drawn.get_parameter(name), plain.get_parameter(name).to(dtype)), name
    odd, odd_plain = drawn.odd.weight.flatten(), plain.odd.weight.flatten()
    assert torch.equal(odd[:-16], odd_plain[:-16].to(dtype))  # its last 16 redrawn, as documented
    assert 0.015 < odd.float().std().item() < 0.025
    assert torch.equal(drawn.norm.weight, torch.ones(32, dtype=dtype))
    assert all(not m.bias.any() for m in drawn.values())
    again, same, other = _mixed(dtype), _mixed(dtype), _mixed(dtype)
    for module, seed in ((again, 3), (same, 3), (other, 4)):
        init_dummy_weights(module, seed=seed)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), same.parameters(), strict=True))
    assert not torch.equal(again.proj.weight, other.proj.weight)
    strided = again.strided  # drawn contiguous in its dtype, then copied into the view
    assert strided.dtype == dtype and not strided.is_contiguous()
    assert 0.015 < strided.float().std().item() < 0.025
