"""The nano LLM's one-token frame steps through the decode graphs (``model_kwargs.cuda_graphs``),
on the CPU: the graph runner runs the recorded step eagerly over the same static buffers,
buckets and padding, so everything but the capture itself is checked here.

Two engines of the tiny deployment of ``test_nemotron_duplex_served.py`` (dummy weights, the
same seed, ``max_concurrent_requests`` 4: buckets 1, 2, 4) run one script of calls: a prompted
call and one without a prompt (its first frame is its one-token first step), a third and a
fourth joining mid-stream, one leaving. Every step's logits (text and tool-call heads) and
tokens match eager, the Mamba states and KV pages of every live call too; three calls run in
bucket 4 with one padded row, which writes only the sink slot and the scratch page. The step
a graph records reads nothing back on the host (``HostReads``); the attention inside runs the
torch reference here, which reads the step's lengths, and is not counted: on CUDA the graph
runs the Triton kernels (``_nano_graphs``), as every graphed family does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mstar.engine.base import EngineItem
from tests.e2e.test_nemotron_duplex_served import _config, checkpoint  # noqa: F401  (checkpoint: a fixture)
from tests.model.nemotron_duplex.test_duplex_build_dtype import spec_of
from tests.support.graph_device import DEVICE, REPLAYS_RUN_PYTHON, on_cuda_replays_run_no_python
from tests.support.host_reads import HostReads

NANO = "nano_llm"
PARAMS = {"sampling": {"temperature": 0.0}, "max_new_tokens": 1 << 30, "stop_token_ids": [],
          "text_penalties": {"repetition": 1.3, "presence": 0.2}}
TOL = 1e-5  # float32: a padded bucket may sum a matrix product in another order
SENTINEL = 123.0
ATTENTION_SITES = ("mstar/layers/attention.py", "mstar/layers/paged_kv.py")  # the torch reference's reads


@pytest.fixture(scope="module")
def folder(checkpoint: Path, tmp_path_factory) -> Path:  # noqa: F811
    """The tiny checkpoint with the release's tool-call head, so that its logits are graphed too."""
    folder = tmp_path_factory.mktemp("nemotron_duplex_graphs")
    for file in checkpoint.iterdir():
        shutil.copy(file, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"use_function_head": True}))
    return folder


def spec(folder: Path, cuda_graphs: bool, calls: int = 4):
    knobs = _config(folder)["model_kwargs"] | {"cuda_graphs": cuda_graphs}
    return spec_of(folder, max_concurrent_requests=calls, dtype="float32", model_kwargs=knobs)


def nano(folder: Path, cuda_graphs: bool):
    return spec(folder, cuda_graphs).build_engines({NANO}, DEVICE)[NANO]


def recorded(engine) -> list[torch.Tensor]:
    """Every step's logits as the rules see them (``[B, 2 V]``), in order."""
    logits: list[torch.Tensor] = []
    rules = engine.inner.rules
    choose = rules.choose
    rules.choose = lambda x, *args, **kwargs: logits.append(x.clone()) or choose(x, *args, **kwargs)
    return logits


def frame(call: str, tick: int, hidden: int) -> torch.Tensor:
    seed = 1000 * tick + sum(map(ord, call))
    return torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed))


# (tick, what): calls primed before that tick's frames, calls that leave after it
SCRIPT = {0: {"prime": {"a": [1, 40, 41, 2], "b": []}}, 1: {"prime": {"c": []}}, 3: {"prime": {"d": [1, 50, 2]}},
          4: {"leave": ["b"]}, 6: {"leave": ["a", "c", "d"]}}


def play(engine, hidden: int) -> list[dict[str, int]]:
    """The script: each tick's tokens per call."""
    live: list[str] = []
    out = []
    for tick in range(7):
        primes = SCRIPT.get(tick, {}).get("prime", {})
        if primes:
            engine.run([EngineItem(c, "prime", 0, {"prompt_ids": torch.tensor(p, dtype=torch.int64)}, PARAMS)
                        for c, p in primes.items()])
            live += list(primes)
        results = engine.run([EngineItem(c, "frame", tick, {"frame": frame(c, tick, hidden)}, PARAMS) for c in live])
        out.append({c: int(r.outputs["token"][0]) for c, r in zip(live, results)})
        for call in SCRIPT.get(tick, {}).get("leave", []):
            engine.release(call)
            live.remove(call)
    return out


def state_of(engine, call: str) -> list[torch.Tensor]:
    forward = engine.inner.forward
    slot = forward.states.slot(call)
    return [t[slot] for t in forward.slot_tensors()]


def test_graphed_frame_steps_equal_eager(folder: Path) -> None:
    eager, graphed = nano(folder, False), nano(folder, True)
    assert eager.inner.graphs is None and graphed.inner.graphs.graphs.batch_sizes == (1, 2, 4)
    hidden = graphed.model.config.hidden_size
    steps = []
    runs = graphed.inner.graphs.graphs.run

    def counted(batch, inputs):
        steps.append(batch)
        return runs(batch, inputs)

    graphed.inner.graphs.graphs.run = counted
    logits = {id(e): recorded(e) for e in (eager, graphed)}
    assert play(eager, hidden) == play(graphed, hidden)
    # every frame step ran in a bucket (the first frames of b and c, one-token first steps, by
    # themselves): b, a; c, a+b; a+b+c (bucket 4, one padded row); four calls twice; b gone,
    # three. Only the prompts' prefills (a's, d's) ran eagerly.
    assert steps == [1, 1, 1, 2, 3, 4, 4, 3, 3], steps
    a, b = logits[id(eager)], logits[id(graphed)]
    assert len(a) == len(b) == 2 + 9
    for x, y in zip(a, b):
        assert x.shape == y.shape and (x - y).abs().max() <= TOL * y.abs().max()


def test_graphed_states_and_pages_equal_eager_and_padding_writes_the_sink(folder: Path) -> None:
    eager, graphed = nano(folder, False), nano(folder, True)
    hidden = graphed.model.config.hidden_size
    forward = graphed.inner.forward
    sink, scratch = forward.states.sink, graphed.inner.pool.num_pages
    for t in forward.slot_tensors():  # what no call may ever read: a value it would show
        t[sink] = SENTINEL
    for cache in graphed.inner.kv_caches:
        cache[:, scratch] = SENTINEL
    for engine in (eager, graphed):
        engine.run([EngineItem(c, "prime", 0, {"prompt_ids": torch.tensor([1, 40, 2])}, PARAMS) for c in "xyz"])
        for tick in range(3):
            engine.run([EngineItem(c, "frame", tick, {"frame": frame(c, tick, hidden)}, PARAMS) for c in "xyz"])
    if REPLAYS_RUN_PYTHON:
        assert graphed.inner.graphs.captured_batch_sizes == (4,)  # three calls: bucket 4, one padded row
    for call in "xyz":
        for x, y in zip(state_of(eager, call), state_of(graphed, call)):
            assert (x - y).abs().max() <= TOL * max(y.abs().max(), 1e-6)
        pages = graphed.inner.pool.page_table(call)
        for x, y in zip(eager.inner.kv_caches, graphed.inner.kv_caches):
            assert (x[:, pages] - y[:, pages]).abs().max() <= TOL * y[:, pages].abs().max()
    # the padded row wrote the sink slot and the scratch page, and nothing of them reached a call
    assert (forward.conv_states[0][sink] != SENTINEL).any() and (forward.ssm_states[0][sink] != SENTINEL).any()
    assert (graphed.inner.kv_caches[0][:, scratch] != SENTINEL).any()
    for engine in (eager, graphed):
        for call in "xyz":
            engine.release(call)
        assert engine.inner.forward.states.num_used == 0 and engine.inner.pool.num_used_pages == 0


@on_cuda_replays_run_no_python  # on CUDA the capture itself fails on a host read
def test_the_recorded_step_reads_nothing_on_the_host(folder: Path) -> None:
    graphed = nano(folder, True)
    hidden = graphed.model.config.hidden_size
    runner = graphed.inner.graphs.graphs.runner
    step, seen = runner.step, []

    def watched(bucket):
        with HostReads(ignore=ATTENTION_SITES) as reads:
            out = step(bucket)
        seen.append(reads)
        return out

    runner.step = watched  # off CUDA a replay runs the step
    no_prompt = torch.zeros(0, dtype=torch.int64)
    graphed.run([EngineItem(c, "prime", 0, {"prompt_ids": no_prompt}, PARAMS) for c in "pqr"])
    for tick in range(2):
        graphed.run([EngineItem(c, "frame", tick, {"frame": frame(c, tick, hidden)}, PARAMS) for c in "pqr"])
    assert len(seen) == 2  # the first frames (one-token first steps) and the second, in bucket 4
    for reads in seen:
        assert reads.count() == 0 and not reads.uploads, reads.report()


def test_cuda_deployment_runs_triton_attention_and_captures_up_to_its_calls(folder: Path) -> None:
    cuda = torch.device("cuda")
    assert spec(folder, False, calls=12)._nano_graphs(cuda) == {"attention_backend": "torch"}
    graphed = spec(folder, True, calls=12)
    assert graphed._nano_graphs(cuda) == {"attention_backend": "triton", "cuda_graphs": True,
                                          "graph_batch_sizes": (1, 2, 4, 8, 12)}
    assert graphed._nano_graphs(torch.device("cpu"))["attention_backend"] == "torch"
