"""The multi-GPU driver (``benchmarks/multi_gpu.py``) without GPUs: its list and refusals,
the shapes against the released configs as the repository records them, the shipped
configs placed at those shapes (the dry run of each layout), the layer count that fits a
card against the models built on the meta device, and the smoke of the cheapest run (TP=2
against TP=1 through ``mstar serve``, two gloo ranks). The other runs' smokes take 20-80 s
each on a 2-core machine: set ``MSTAR_MULTI_GPU_SMOKE_ALL=1`` to run them too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks import multi_gpu as mg
from benchmarks import multi_gpu_checkpoints as ckpts

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EVERY_SMOKE = os.environ.get("MSTAR_MULTI_GPU_SMOKE_ALL") == "1"


def test_list_names_every_run_with_its_kind_and_time(capsys):
    assert mg.main(["--list"]) == 0
    out = capsys.readouterr().out
    for run in mg.RUNS:
        assert f"| {run.name} | {run.kind} | {run.minutes:g} |" in out
    assert {r.kind for r in mg.RUNS} == {"nvidia-h200-x2", "nvidia-h200-x4", "nvidia-h200-x8"}
    assert all(r.minutes <= 10 for r in mg.RUNS)  # one device command each


def test_a_run_the_machine_cannot_hold_is_refused_naming_the_kind():
    with pytest.raises(SystemExit, match=r"glm52_tp8 needs 8 GPUs \(nvidia-h200-x8\), this machine has 4"):
        mg.refuse_missing_gpus([mg.BY_NAME["qwen3_8_tp4"], mg.BY_NAME["glm52_tp8"]], 4)
    mg.refuse_missing_gpus([mg.BY_NAME["llama_tp2"]], 2)
    with pytest.raises(SystemExit, match="unknown nope"):
        mg.main(["--runs", "llama_tp2,nope"])
    if not torch.cuda.is_available():  # no GPU here: a real run is refused before anything starts
        with pytest.raises(SystemExit, match=r"needs 2 GPUs \(nvidia-h200-x2\), this machine has 0"):
            mg.main(["--runs", "llama_tp2"])


def test_kind_picks_its_runs():
    args = mg.argparse.Namespace(runs=None, kind="nvidia-h200-x4")
    assert [r.name for r in mg.pick(args)] == ["qwen3_8_tp4", "command_a_tp4"]


def test_smoke_groups_fit_two_ranks():
    assert mg._two_ranks({"node_names": ["llm"], "ranks": list(range(8)), "tp_size": 8}) == {
        "node_names": ["llm"], "ranks": [0, 1], "tp_size": 2}
    assert mg._two_ranks({"node_names": ["dit_uncond"], "ranks": [1]}) == {"node_names": ["dit_uncond"], "ranks": [1]}


@pytest.mark.parametrize("stop, raised", [(RuntimeError("boom"), None), (KeyboardInterrupt(), KeyboardInterrupt)])
def test_a_failed_or_stopped_run_still_writes_the_arms_it_finished(tmp_path, stop, raised):
    def fn(settings, arms):
        arms["tp=1"] = {"startup_s": 1.0}
        raise stop

    run = mg.Run("fake", 2, 1, "a run stopped after its first arm", fn)
    settings = mg.Settings(smoke=True, streams=(1,), prompt_len=4, new_tokens=4, runs=1, warmup_tokens=2, seed=0,
                           workdir=tmp_path)
    if raised:
        with pytest.raises(raised):
            mg.measure(run, settings, str(tmp_path))
    else:
        assert mg.measure(run, settings, str(tmp_path))["errors"] == {"fake": "RuntimeError: boom"}
    [path] = tmp_path.glob("multi_gpu_fake_smoke-*.json")
    record = json.loads(path.read_text())
    assert record["arms"] == {"tp=1": {"startup_s": 1.0}} and record["errors"]["fake"]


def test_fast_paths_on_cuda_unless_eager(tmp_path):
    base = dict(streams=(1, 64), prompt_len=128, new_tokens=128, runs=2, warmup_tokens=16, seed=0, workdir=tmp_path)
    cuda = mg.Settings(smoke=False, **base)
    assert cuda.fast_paths() == {"attention_backend": "triton", "cuda_graphs": True}
    assert cuda.fast_paths(cuda_graphs=False) == {"attention_backend": "triton"}
    assert mg.Settings(smoke=False, eager=True, **base).fast_paths() == {}
    assert mg.Settings(smoke=True, **base).fast_paths() == {}
    config = mg.llama_settings(cuda, "llama_tp2.yaml", tmp_path, 16, **mg.ONE_GPU)
    assert config["model_kwargs"] == {"attention_backend": "triton", "cuda_graphs": True}
    assert (config["gpus"], config["max_concurrent_requests"], config["max_seq_len"]) == ([0], 64, 288)
    assert config["resources"]["kv_cache"] == {"max_num_pages": 64 * 16 + 8, "page_size": 16}


# ------------------------------------------------------------------------------ shapes
def test_shapes_are_the_released_configs_the_repository_records():
    from benchmarks.s16_glm52_layers import CMDA
    from mstar.model.glm52.config import Glm52Config
    from tests.distributed.test_qwen3_5_tp import QWEN3_8_27B

    assert {k: ckpts.QWEN3_8_27B_TEXT[k] for k in QWEN3_8_27B["text_config"]} == QWEN3_8_27B["text_config"]
    glm = Glm52Config.from_dict({})  # the defaults: the release's config
    assert {k: v for k, v in ckpts.GLM_5_2.items() if hasattr(glm, k)} == {
        k: getattr(glm, k) for k in ckpts.GLM_5_2 if hasattr(glm, k)}
    assert {k: ckpts.COMMAND_A_PLUS[k] for k in CMDA if k != "num_hidden_layers"} == {
        k: v for k, v in CMDA.items() if k != "num_hidden_layers"}
    assert (ckpts.COMMAND_A_PLUS["hidden_size"], ckpts.COMMAND_A_PLUS["intermediate_size"]) == (8192, 2048)  # S16's
    # the comments of the shipped TP configs name the same head counts
    assert "attention heads (24), KV heads (4), DeltaNet key (16) and value\n# (48)" in (
        CONFIGS / "qwen3_8_27b_tp4.yaml").read_text()
    assert "(64), the dense MLP width (12288) and an expert's width (2048)" in (CONFIGS / "glm52.yaml").read_text()


@pytest.mark.parametrize("family, shapes, writer", [
    ("command_a_plus", ckpts.COMMAND_A_PLUS, ckpts.command_a_plus_dir),
    ("glm52", ckpts.GLM_5_2, ckpts.glm52_dir),
])
def test_layer_sizes_match_the_models_built_on_meta(tmp_path, family, shapes, writer):
    """The count ``layers_that_fit`` uses is the model's own, to 0.1 %: a MoE layer and the
    embeddings and head of the real shapes, the model built on the meta device (no memory)."""
    from mstar.model.command_a_plus.checkpoint import CommandAPlusCheckpoint
    from mstar.model.command_a_plus.modeling import CommandAPlusForCausalLM
    from mstar.model.glm52.checkpoint import Glm52Checkpoint
    from mstar.model.glm52.modeling import Glm52ForCausalLM

    last = 3 if family == "glm52" else 0  # GLM-5.2's first three layers are dense: the fourth is a MoE one
    folder = writer(tmp_path / family, smoke=False, layers=last + 1)
    with torch.device("meta"):
        if family == "glm52":
            model = Glm52ForCausalLM(Glm52Checkpoint.locate(str(folder)).config())
        else:
            model = CommandAPlusForCausalLM(CommandAPlusCheckpoint.locate(folder).config())
    named = dict(model.named_parameters())
    layer = sum(p.numel() for n, p in named.items() if f".layers.{last}." in n)
    outside = sum(p.numel() for n, p in named.items() if ".layers." not in n)
    counted_layer, counted_outside = ckpts.decoder_layer_params(family, shapes)
    assert counted_layer == pytest.approx(layer, rel=1e-3)
    assert counted_outside == pytest.approx(outside, rel=1e-3)


def test_layers_that_fit_a_card():
    gib = 1 << 30
    # Command A+ whole (32 layers, ~215B) at TP4 on 141 GB cards; on 80 GB ones ~18 layers
    assert ckpts.layers_that_fit("command_a_plus", ckpts.COMMAND_A_PLUS, 4, 141 * 10**9, 16 * gib) == 32
    assert 15 <= ckpts.layers_that_fit("command_a_plus", ckpts.COMMAND_A_PLUS, 4, 80 * 10**9, 16 * gib) <= 20
    # GLM-5.2 (78 layers, ~770B counted in bf16) never whole on eight cards of either size
    h200 = ckpts.layers_that_fit("glm52", ckpts.GLM_5_2, 8, 141 * 10**9, 16 * gib)
    assert 40 <= h200 < 78 and ckpts.layers_that_fit("glm52", ckpts.GLM_5_2, 8, 80 * 10**9, 16 * gib) < h200


# -------------------------------------------------------------------- dry runs (placement)
LAYOUTS = [  # (yaml, checkpoint writer, the driver's overrides, split group's ranks and tp size)
    ("llama_tp2.yaml", lambda d: ckpts.llama_dir(d, smoke=False), {}, (0, 1), 2),
    ("llama_pd_disagg.yaml", lambda d: ckpts.llama_dir(d, smoke=False), {"gpus": [0, 1]}, None, None),
    ("qwen3_8_27b_tp4.yaml", lambda d: ckpts.qwen3_8_dir(d, smoke=False), {}, (0, 1, 2, 3), 4),
    ("command_a_plus_tp4.yaml", lambda d: ckpts.command_a_plus_dir(d, smoke=False), {}, (0, 1, 2, 3), 4),
    ("glm52.yaml", lambda d: ckpts.glm52_dir(d, smoke=False), {}, tuple(range(8)), 8),
]


@pytest.mark.parametrize("yaml_name, writer, overrides, ranks, size", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_shipped_layouts_place_the_released_shapes(tmp_path, yaml_name, writer, overrides, ranks, size):
    """Each run's deployment, as the driver builds it for the GPUs, passes the config's
    validation and placement (tp_size divides every head count and width it splits)."""
    from mstar.config import parse_config
    from mstar.model.registry import model_class
    from mstar.runtime.placement import build_placement

    settings = mg.Settings(smoke=False, streams=(1, 64), prompt_len=128, new_tokens=128, runs=2, warmup_tokens=16,
                           seed=0, workdir=tmp_path)
    config = parse_config(mg.deployment(settings, yaml_name, writer(tmp_path / "ckpt"), **overrides))
    assert config.load_format == "dummy" and config.device == "cuda"
    spec = model_class(config.model)(config)
    placement = build_placement(spec.graph(), config, spec)
    split = placement.split_groups()
    if ranks is None:
        assert split == []
    else:
        (group,) = split
        assert (group.ranks, group.tp_size) == (ranks, size)


# ------------------------------------------------------------------------------- smokes
def _smoke(tmp_path: Path, run: str) -> dict:
    assert mg.main(["--smoke", "--runs", run, "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"multi_gpu_{run}_smoke-*.json")
    record = json.loads(path.read_text())
    assert not record["errors"] and record["kind"] == mg.BY_NAME[run].kind
    return record


@pytest.mark.slow
def test_llama_tp2_smoke_records_the_scaling_efficiency(tmp_path):
    record = _smoke(tmp_path, "llama_tp2")
    assert set(record["arms"]) == {"tp=1", "tp=2"}
    assert record["arms"]["tp=2"]["config"]["node_groups"] == [{"node_names": ["llm"], "ranks": [0, 1], "tp_size": 2}]
    rows = {m["metric"]: m for m in record["metrics"]}
    tp2, tp1 = rows["throughput@3 tp=2"]["ours"], rows["throughput@3 tp=1"]["ours"]
    ratio = rows["tp=2 vs tp=1 throughput@3"]
    assert (ratio["ours"], ratio["baseline"]) == (tp2, tp1)
    assert ratio["notes"]["scaling_efficiency"] == pytest.approx(tp2 / (2 * tp1))
    assert any(line.startswith("| llama_tp2 | tp=2 vs tp=1 throughput@3 (tok/s) |") for line in record["summary"])


@pytest.mark.slow
@pytest.mark.skipif(not EVERY_SMOKE, reason="20-80 s each: set MSTAR_MULTI_GPU_SMOKE_ALL=1")
@pytest.mark.parametrize("run", [r.name for r in mg.RUNS if r.name != "llama_tp2"])
def test_every_other_smoke(tmp_path, run):
    record = _smoke(tmp_path, run)
    assert record["metrics"]
    if mg.BY_NAME[run].gpus == 2:  # every two-GPU run has a same-run baseline and a ratio row
        assert record["summary"]

