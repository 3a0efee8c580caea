"""Overlap scheduling (``model_kwargs.overlap_scheduling``) against the eager reference.

With overlap on, the autoregressive engine launches each sequence's next decode before the
host has read the current step's tokens; a sequence that stops has that extra step thrown
away and its pages rolled back. Greedy outputs must be the same as without overlap, for
one and for several concurrent requests with different budgets, EOS ids and stop strings,
and every KV page must come back. A tiny random Llama on the CPU, through the in-process
runtime as the server drives it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from benchmarks.common import tiny_llama_dir
from mstar.config import parse_config
from mstar.engine.base import EngineItem
from mstar.model.registry import model_class
from mstar.model.spec import WalkRequest
from mstar.runtime.launch import Deployment, start
from tests.support.markers import needs_cuda
from tests.support.models import GPU_LLAMA, random_llama

PAGE_SIZE = 4  # small pages: steps launched ahead often open a page that must be rolled back
PROMPTS = [[5, 9, 300, 17], [400, 3, 3, 80, 81, 82, 7], [260], [11, 12, 13, 14, 15, 16, 17, 18, 19], [100, 200]]


@dataclass
class Outcome:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event) -> None:
        if event is None:
            self.done.set()
            return
        self.text += event.text
        self.token_ids += event.token_ids
        self.finish_reason = event.finish_reason or self.finish_reason
        self.error = event.error or self.error


@dataclass(frozen=True)
class Ask:
    prompt: list[int]
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    sampling: tuple[tuple[str, float], ...] = (("temperature", 0.0),)


def _config(model_dir, overlap: bool) -> dict:
    return {"model": "llama", "model_path": str(model_dir), "load_format": "dummy", "device": "cpu",
            "dtype": "float32", "max_seq_len": 128, "max_concurrent_requests": 8,
            "resources": {"kv_cache": {"max_num_pages": 128, "page_size": PAGE_SIZE}},
            "model_kwargs": {"overlap_scheduling": overlap}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("overlap"), num_hidden_layers=2)


@pytest.fixture(scope="module")
def deployments(model_dir):
    eager = start(parse_config(_config(model_dir, False)), in_process=True)
    overlap = start(parse_config(_config(model_dir, True)), in_process=True)
    try:
        yield eager, overlap
    finally:
        eager.close()
        overlap.close()


def _engine(d: Deployment):
    return d.runtime.workers.workers[0].engines["llm"]


_ids = iter(range(1 << 30))


def _submit(d: Deployment, ask: Ask) -> Outcome:
    params = {"sampling": dict(ask.sampling), "max_new_tokens": ask.max_tokens,
              "max_decode_steps": ask.max_tokens - 1, "stop_token_ids": list(ask.stop_ids)}
    pages = -(-(len(ask.prompt) + ask.max_tokens) // PAGE_SIZE)
    request = WalkRequest("chat", {"prompt_ids": torch.tensor(ask.prompt)}, params, {"kv_pages": pages},
                          prompt_tokens=len(ask.prompt))
    out = Outcome()
    d.runtime.submit(f"req-{next(_ids)}", request, d.spec.output_stream(request, list(ask.stop)), out)
    return out


def _run(d: Deployment, asks: list[Ask], stagger: int = 0) -> list[Outcome]:
    """Submit every ask at once, or (``stagger`` > 0) each once the previous one has that
    many tokens, so prefills join while other requests decode; wait for all to finish."""
    outs = []
    for ask in asks:
        while stagger and outs and len(outs[-1].token_ids) < stagger and not outs[-1].done.is_set():
            time.sleep(0.001)
        outs.append(_submit(d, ask))
    for out in outs:
        assert out.done.wait(60), "a request did not finish"
        assert out.error is None, out.error
    _check_drained(d)
    return outs


def _check_drained(d: Deployment) -> None:
    engine = _engine(d)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (engine.pool.num_used_pages == 0 and d.runtime.conductor.idle):
        time.sleep(0.01)
    assert engine.pool.num_used_pages == 0, f"KV pages still held by {engine.pool.seq_ids()}"
    assert engine.seqs == {} and engine._ahead is None
    engine.pool.check_invariants()


def _same(a: list[Outcome], b: list[Outcome]) -> None:
    assert [(o.text, o.token_ids, o.finish_reason) for o in a] == [(o.text, o.token_ids, o.finish_reason) for o in b]


def test_one_request(deployments):
    eager, overlap = deployments
    ask = [Ask(PROMPTS[0], 24)]
    reference = _run(eager, ask)
    assert len(reference[0].token_ids) == 24 and reference[0].finish_reason == "length"
    _same(reference, _run(overlap, ask))


def test_concurrent_budgets_eos_and_stop_strings(deployments):
    eager, overlap = deployments
    plain = [Ask(p, n) for p, n in zip(PROMPTS, (17, 1, 9, 30, 5))]
    reference = _run(eager, plain)
    # An EOS id and a stop string each request really meets midway through its reply.
    eos = reference[3].token_ids[6]
    cut = reference[0].text[len(reference[0].text) // 2:][:2]
    assert cut.strip(), reference[0].text
    asks = [Ask(PROMPTS[0], 17, stop=(cut,)), plain[1], plain[2], Ask(PROMPTS[3], 30, stop_ids=(eos,)), plain[4]]
    reference = _run(eager, asks)
    assert reference[0].finish_reason == "stop" and cut not in reference[0].text
    assert reference[3].finish_reason == "stop" and len(reference[3].token_ids) <= 7
    assert [len(o.token_ids) for o in reference[1:3]] == [1, 9]
    _same(reference, _run(overlap, asks))
    _same(reference, _run(overlap, asks))  # again, with the engine's buffers warm


def test_staggered_arrivals(deployments):
    """Prefills arrive while others decode: a plan mixes steps launched ahead with new ones."""
    eager, overlap = deployments
    asks = [Ask(p, n) for p, n in zip(PROMPTS, (20, 12, 16, 8, 10))]
    _same(_run(eager, asks, stagger=3), _run(overlap, asks, stagger=3))


def test_seeded_sampling_next_to_greedy(deployments):
    """A seeded row runs ahead beside the greedy rows, and draws what eager draws."""
    eager, overlap = deployments
    seeded = (("temperature", 0.9), ("top_k", 50), ("seed", 7))
    asks = [Ask(PROMPTS[0], 12), Ask(PROMPTS[1], 12, sampling=seeded), Ask(PROMPTS[3], 12)]
    reference = _run(eager, asks)
    assert reference[1].token_ids != reference[0].token_ids
    _same(reference, _run(overlap, asks))


def test_repetition_penalty_next_to_plain_rows(deployments):
    """A repetition penalty reads every token, the one in flight too: the engine marks that
    one on the device, so penalised rows run ahead and end as eager's, arriving staggered."""
    eager, overlap = deployments
    penalised = (("temperature", 0.0), ("repetition_penalty", 1.8))
    asks = [Ask(p, n, sampling=penalised) for p, n in zip(PROMPTS, (20, 12, 16, 8, 10))] + [Ask(PROMPTS[0], 14)]
    reference = _run(eager, asks)
    assert reference[0].token_ids[:14] != reference[5].token_ids  # the penalty bites
    _same(reference, _run(overlap, asks))
    _same(reference, _run(overlap, asks, stagger=3))


# ------------------------------------------------------------- the engine alone
def _engines(model_dir):
    made = []
    for overlap in (False, True):
        config = parse_config(_config(model_dir, overlap))
        made.append(model_class("llama")(config).build_engines({"llm"}, torch.device("cpu"))["llm"])
    return made


def _prefill(rid: str, prompt: list[int], max_new: int) -> EngineItem:
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": max_new, "stop_token_ids": []}
    return EngineItem(rid, "prefill", 0, {"prompt_ids": torch.tensor(prompt)}, params)


def _decode(rid: str, token: torch.Tensor) -> EngineItem:
    return EngineItem(rid, "decode", 0, {"token": token}, {})


def test_engine_rolls_back_a_dropped_sequence(model_dir):
    """A plan that leaves a sequence out (it was cancelled) discards the step launched ahead
    for it: its pages shrink back to its known tokens, and it can decode again later."""
    eager, overlap = _engines(model_dir)
    results = {}
    for engine in (eager, overlap):
        outs = engine.run([_prefill("a", PROMPTS[1], 40), _prefill("b", PROMPTS[2], 40)])
        tokens = {"a": [outs[0].outputs["token"]], "b": [outs[1].outputs["token"]]}
        for _ in range(5):  # "b" sits out five plans
            tokens["a"] += [engine.run([_decode("a", tokens["a"][-1])])[0].outputs["token"]]
            # Eager holds the slots of the tokens in the cache; overlap also the newest
            # token's, written by the step launched ahead ("b"'s next one rolled back).
            for rid, seq in engine.seqs.items():
                assert engine.pool.seq_len(rid) == len(seq.tokens) - (engine is eager), rid
        for _ in range(4):  # then both decode again
            outs = engine.run([_decode("b", tokens["b"][-1]), _decode("a", tokens["a"][-1])])
            tokens["b"].append(outs[0].outputs["token"])
            tokens["a"].append(outs[1].outputs["token"])
        results[engine is overlap] = {rid: [int(t) for t in ts] for rid, ts in tokens.items()}
        engine.pool.check_invariants()
        engine.release("a")
        engine.release("b")
        assert engine.pool.num_used_pages == 0 and engine._ahead is None
    assert results[True] == results[False]


def test_a_seeded_row_that_sits_out_plans_draws_as_eager(model_dir):
    """A step launched ahead for a seeded sampling row drew from its generator; when the row
    sits out the next plans the step is discarded and the generator put back, so the row
    later draws the numbers eager draws."""
    eager, overlap = _engines(model_dir)
    results = []
    for engine in (eager, overlap):
        items = [_prefill("a", PROMPTS[1], 40), _prefill("b", PROMPTS[2], 40)]
        items[1].params["sampling"] = {"temperature": 1.0, "seed": 11}
        outs = engine.run(items)
        tokens = {"a": [outs[0].outputs["token"]], "b": [outs[1].outputs["token"]]}
        for sits_out in (3, 0, 2, 0, 0):
            for _ in range(sits_out):
                tokens["a"].append(engine.run([_decode("a", tokens["a"][-1])])[0].outputs["token"])
            outs = engine.run([_decode("b", tokens["b"][-1]), _decode("a", tokens["a"][-1])])
            tokens["b"].append(outs[0].outputs["token"])
            tokens["a"].append(outs[1].outputs["token"])
            assert (engine._ahead is not None and "b" in engine._ahead.rows) == (engine is overlap)
        results.append({rid: [int(t) for t in ts] for rid, ts in tokens.items()})
        engine.release("a")
        engine.release("b")
    assert results[0] == results[1]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0, "seed": 3}, {"temperature": 0.0, "repetition_penalty": 1.5}],
                         ids=["greedy-seeded", "penalised"])
def test_rows_that_need_nothing_from_the_host_run_ahead(model_dir, sampling):
    """A seed on a greedy request (as a transcription's parameters carry) makes a generator
    that never draws; a repetition penalty marks the unread token on the device. Either way
    the next step is launched ahead, and the tokens equal eager's."""
    eager, overlap = _engines(model_dir)
    results = []
    for engine in (eager, overlap):
        item = _prefill("a", PROMPTS[1], 12)
        item.params["sampling"] = sampling
        token = engine.run([item])[0].outputs["token"]
        tokens = [int(token)]
        for _ in range(10):
            token = engine.run([_decode("a", token)])[0].outputs["token"]
            tokens.append(int(token))
            assert (engine._ahead is not None) == (engine is overlap)
        results.append(tokens)
        engine.release("a")
        assert engine.seen.slots == {}
    assert results[0] == results[1]


# (plan: request ids that decode, and prompts that join with a prefill)
SCRIPT = [((), {"a": [5, 6, 7], "b": list(range(40, 73)), "c": [9]}), (("a", "b", "c"), {}), (("a", "b", "c"), {}),
          (("a", "c"), {}), (("a", "c"), {}), (("c", "b", "a"), {"d": [1, 2, 3, 4]}), (("a", "b", "c", "d"), {}),
          (("b", "d"), {}), (("a", "b", "c", "d"), {}), (("a", "b", "c", "d"), {})]


def _drive(engine) -> dict[str, list[int]]:
    """Run SCRIPT: decodes in shifting order, sequences sitting plans out, one joining late."""
    history: dict[str, list[int]] = {}
    for decodes, joins in SCRIPT:
        items = [_decode(rid, torch.tensor([history[rid][-1]])) for rid in decodes]
        items += [_prefill(rid, prompt, 40) for rid, prompt in joins.items()]
        for item, out in zip(items, engine.run(items)):
            history.setdefault(item.request_id, []).append(int(out.outputs["token"]))
    for rid in history:
        engine.release(rid)
    assert engine.pool.num_used_pages == 0 and engine._ahead is None
    return history


def test_engine_script_matches_eager(model_dir):
    eager, overlap = _engines(model_dir)
    assert _drive(overlap) == _drive(eager)


@needs_cuda(triton=True)
def test_overlap_with_cuda_graphs_matches_eager_on_gpu():
    """On the GPU: Triton attention, graph-replayed decodes and overlap against the eager
    PyTorch reference, token for token (float32)."""
    from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout

    device = torch.device("cuda")
    model = random_llama(device, **GPU_LLAMA)
    layout = KVLayout(2, 2, 64)
    common = dict(num_pages=64, page_size=16, max_seq_len=128, device=device, dtype=torch.float32)
    eager = AutoregressiveEngine(model, layout, **common)
    fast = AutoregressiveEngine(model, layout, cuda_graphs=True, graph_batch_sizes=(1, 2, 4),
                                attention_backend="triton", overlap_scheduling=True, **common)
    assert _drive(fast) == _drive(eager)
    assert fast.graphs.captured_batch_sizes  # the steps launched ahead replayed graphs


@needs_cuda(triton=True)
def test_steps_launched_ahead_never_wait_for_the_device():
    """Launching the next step (the graph replay, a repetition penalty, seeded draws, top-p,
    Orpheus's code mask) only queues GPU work: under torch's sync debug mode any host wait
    in it raises. A host wait there is what made overlap scheduling do nothing for S3."""
    from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
    from mstar.model.orpheus.engine import TalkerRules

    device = torch.device("cuda")
    model = random_llama(device, vocab_size=156940, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    engine = AutoregressiveEngine(model, KVLayout(2, 2, 16), num_pages=64, page_size=16, max_seq_len=128,
                                  device=device, dtype=torch.float32, rules=TalkerRules(), cuda_graphs=True,
                                  graph_batch_sizes=(1, 2, 4), attention_backend="triton", overlap_scheduling=True)
    engine.graphs.capture_all()
    launch = engine._launch_ahead

    def strict(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launch(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine._launch_ahead = strict
    orpheus = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1}
    sampling = [orpheus | {"seed": 1}, orpheus, {"temperature": 0.0}]
    outs = engine.run([EngineItem(f"r{i}", "prefill", 0, {"prompt_ids": torch.tensor([5, 6, 7 + i])},
                                  {"sampling": s, "max_new_tokens": 20, "stop_token_ids": [], "audio_only": True})
                       for i, s in enumerate(sampling)])
    for _ in range(8):
        outs = engine.run([EngineItem(f"r{i}", "decode", 0, {"token": out.outputs["token"]}, {})
                           for i, out in enumerate(outs)])
        assert engine._ahead is not None and len(engine._ahead.rows) == 3
        assert all("code" in out.outputs for out in outs)


def test_engine_failure_rolls_back(model_dir):
    """A batch that fails leaves no pages reserved ahead: the worker's item-by-item retry
    then runs on a consistent pool."""
    _, overlap = _engines(model_dir)
    out = overlap.run([_prefill("a", PROMPTS[0], 40)])[0]
    assert overlap._ahead is not None and overlap.pool.seq_len("a") == len(PROMPTS[0]) + 1
    with pytest.raises(RuntimeError, match="does not follow"):
        overlap.run([_decode("a", out.outputs["token"] + 1)])  # a wrong input token
    assert overlap._ahead is None
    assert overlap.pool.seq_len("a") == len(overlap.seqs["a"].tokens)
    overlap.run([_decode("a", out.outputs["token"])])  # and it decodes on from there
    overlap.pool.check_invariants()


def test_fast_paths_follow_what_the_forward_allows(model_dir):
    """A forward whose per-request state a discarded step would leave advanced refuses overlap
    scheduling; one without decode graphs refuses cuda_graphs (at construction, naming it)."""
    from mstar.engine.autoregressive import AutoregressiveEngine
    from mstar.engine.forward import Forward

    class Stateful(Forward):
        runs_ahead = False

        def __init__(self, model):
            super().__init__(model)
            self.graph_rows = None

    plain = _engines(model_dir)[0]
    kwargs = dict(num_pages=8, page_size=PAGE_SIZE, max_seq_len=64, device=torch.device("cpu"), dtype=torch.float32)
    for switch in ("overlap_scheduling", "cuda_graphs"):
        with pytest.raises(ValueError, match=f"{switch}: Stateful"):
            AutoregressiveEngine(plain.model, _layout(plain), forward=Stateful(plain.model), **{switch: True}, **kwargs)
    with pytest.raises(ValueError, match="another model"):
        AutoregressiveEngine(plain.model, _layout(plain), forward=Forward(torch.nn.Linear(1, 1)), **kwargs)


def _layout(engine):
    from mstar.engine.autoregressive import KVLayout

    cache = engine.kv_caches[0]
    return KVLayout(len(engine.kv_caches), cache.shape[3], cache.shape[4])


def test_host_overhead_benchmark_runs(tmp_path):
    """benchmarks/host_overhead.py, tiny: it measures the decode phase of every stream count."""
    import json

    from benchmarks import host_overhead

    out = tmp_path / "host.json"
    assert host_overhead.main(["--streams", "1,3", "--new-tokens", "6", "--repeats", "1", "--overlap",
                               "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"1", "3"}
    for row in results.values():
        assert row["steps"] >= 3 and row["host_cpu_ms_per_step"] > 0 and row["wall_ms_per_step"] > 0
