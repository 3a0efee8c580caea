"""Overlap scheduling for Whisper's decoder (``model_kwargs.overlap_scheduling``) against the
eager engine, and the batched token choice against a per-row reference.

With overlap on, the engine launches each sequence's next decode (cross-attention slots,
suppress masks and the sampler on the device) before the host reads the current step's tokens.
Greedy tokens must equal the eager engine's exactly while requests of different lengths join
and leave, stop at EOS, sit out plans, detect their language and translate. Tiny random models
in float32 on the CPU (helpers of test_whisper_cross_slots.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_whisper_cross_slots import SOT, TOKENS, features, tiny_engine, tiny_model

from mstar.engine.autoregressive import AutoregressiveEngine
from mstar.engine.base import EngineItem


def make_engine(model, overlap: bool, **kwargs) -> AutoregressiveEngine:
    return tiny_engine(model, max_requests=6, num_pages=96, overlap_scheduling=overlap, **kwargs)


def request(prompt: list[int], new_tokens: int, *, stop: tuple[int, ...] = (), detect: bool = False,
            task: str = "transcribe") -> dict:
    return {"prompt": prompt, "params": {"sampling": {"temperature": 0.0}, "max_new_tokens": new_tokens,
                                         "stop_token_ids": list(stop), "detect_language": detect, "task": task}}


def serve(engine: AutoregressiveEngine, requests: dict[str, dict], joins: dict[str, int],
          sits_out: dict[str, set[int]] | None = None) -> tuple[dict[str, list[int]], int]:
    """Drive the engine like the conductor: request ``r`` is prefilled at plan ``joins[r]``,
    then decodes every plan (except those in ``sits_out[r]``) until a step flags a stop, when
    it is released. Returns every request's tokens and how many plans found steps launched
    ahead for them."""
    sits_out = sits_out or {}
    audio = dict(zip(sorted(requests), features(len(requests), seed=11)))
    out: dict[str, list[int]] = {}
    live: list[str] = []
    ahead_used = 0
    plan = 0
    while len(out) < len(requests) or live:
        live += [r for r, at in joins.items() if at == plan]
        step = [r for r in live if plan not in sits_out.get(r, ())]
        items = []
        for r in step:
            if r not in out:
                inputs = {"prompt_ids": torch.tensor(requests[r]["prompt"]), "audio_features": audio[r]}
                items.append(EngineItem(r, "prefill", 0, inputs, requests[r]["params"]))
            else:
                items.append(EngineItem(r, "decode", len(out[r]), {"token": torch.tensor([out[r][-1]])}, {}))
        if engine._ahead is not None:
            ahead_used += any(r in engine._ahead.rows for r in step)
        for r, result in zip(step, engine.run(items) if items else []):
            out.setdefault(r, []).append(int(result.outputs["token"]))
            if "stop" in result.flags:
                live.remove(r)
                engine.release(r)
        plan += 1
        assert plan < 500
    engine.pool.check_invariants()
    assert engine.pool.num_used_pages == 0 and engine.seqs == {} and engine._ahead is None
    assert engine.forward.cross_slots.held() == {}
    return out, ahead_used


def test_overlap_matches_eager_as_requests_join_and_leave() -> None:
    model = tiny_model()
    requests = {
        "a": request([SOT, 101, 103, 105], 23),
        "b": request([SOT, 102, 103, 105], 7),
        "c": request([SOT], 18, detect=True),
        "d": request([SOT], 15, detect=True, task="translate"),
        "e": request([SOT, 101, 104, 105], 30),
        "f": request([SOT, 101, 103], 1),
    }
    joins = {"a": 0, "b": 0, "c": 2, "d": 3, "e": 5, "f": 9}
    sits_out = {"a": {6, 7}, "e": {12}}
    want, _ = serve(make_engine(model, False), requests, joins, sits_out)
    got, ahead_used = serve(make_engine(model, True), requests, joins, sits_out)
    assert got == want
    assert ahead_used > 10  # the overlap path really ran
    # language detection chose a language, then the task and no-timestamps were forced
    assert want["c"][0] in TOKENS.language_ids and want["c"][1:3] == [TOKENS.transcribe, TOKENS.no_timestamps]
    assert want["d"][1:3] == [TOKENS.translate, TOKENS.no_timestamps]
    assert [len(want[r]) for r in "abef"] == [23, 7, 30, 1]


def test_overlap_matches_eager_with_eos_stops() -> None:
    """EOS ids the requests really meet midway: the step launched ahead past it is dropped."""
    model = tiny_model(seed=3)
    plain = {r: request([SOT, 101, 103, 105], 20) for r in "ab"} | {"c": request([SOT], 20, detect=True)}
    joins = {"a": 0, "b": 1, "c": 1}
    reference, _ = serve(make_engine(model, False), plain, joins)
    stops = {r: reference[r][len(reference[r]) // 2] for r in plain}
    stopping = {r: request(plain[r]["prompt"], 20, stop=(stops[r],), detect=plain[r]["params"]["detect_language"])
                for r in plain}
    want, _ = serve(make_engine(model, False), stopping, joins)
    assert all(len(want[r]) < 20 and want[r][-1] == stops[r] for r in plain)
    got, _ = serve(make_engine(model, True), stopping, joins)
    assert got == want


def test_overlap_with_bucketed_graph_path_on_cpu() -> None:
    """With ``cuda_graphs`` the steps launched ahead replay the bucketed path (eager on the CPU)."""
    model = tiny_model(seed=1)
    requests = {"a": request([SOT, 101, 103, 105], 12), "b": request([SOT], 9, detect=True),
                "c": request([SOT, 102, 103, 105], 16)}
    joins = {"a": 0, "b": 1, "c": 4}
    want, _ = serve(make_engine(model, False), requests, joins)
    engine = make_engine(model, True, cuda_graphs=True)
    got, ahead_used = serve(engine, requests, joins)
    assert got == want and ahead_used and engine.graphs.captured_batch_sizes


def test_forced_tokens_are_not_launched_ahead() -> None:
    engine = make_engine(tiny_model(), True)
    audio = features(1, seed=2)[0]
    params = request([SOT], 10, detect=True)["params"]
    token = engine.run([EngineItem("a", "prefill", 0, {"prompt_ids": torch.tensor([SOT]), "audio_features": audio},
                                   params)])[0].outputs["token"]
    assert engine._ahead is None  # the task token is forced next: the host decides it
    for _ in range(2):  # task, no-timestamps
        token = engine.run([EngineItem("a", "decode", 1, {"token": token}, {})])[0].outputs["token"]
    assert engine._ahead is not None and list(engine._ahead.rows) == ["a"]  # the first text token


# ---------------------------------------------------------------- the batched choice
def per_row_choose(engine: AutoregressiveEngine, logits: torch.Tensor, seqs) -> list[int]:
    """The per-row choice the batched one replaced (greedy rows)."""
    out = []
    for seq in seqs:
        state = seq.state
        row = logits[len(out)].float()
        if state.forced:
            out.append(state.forced.pop(0))
        elif state.detect and seq.generated == 0:
            ids = list(TOKENS.language_ids)
            out.append(ids[int(row[ids].argmax())])
            task = TOKENS.translate if state.task == "translate" else TOKENS.transcribe
            state.forced = [task, TOKENS.no_timestamps]
        else:
            rules = engine.rules
            mask = rules.begin_mask if seq.generated == state.text_start else rules.suppress_mask
            out.append(int(row.masked_fill(mask, float("-inf")).argmax()))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_batched_choice_matches_per_row_reference(seed: int) -> None:
    engine = make_engine(tiny_model(), False)
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(12):
        detect = bool(torch.randint(2, (1,), generator=gen))
        seq = engine._new_sequence(f"r{i}", [SOT], {"detect_language": detect, "sampling": {"temperature": 0.0},
                                                    "task": ("translate", "transcribe")[i % 2]})
        seq.tokens += [5] * int(torch.randint(5, (1,), generator=gen))  # 0..4 generated
        if detect and 0 < seq.generated < 3:
            seq.state.forced = [TOKENS.transcribe, TOKENS.no_timestamps][seq.generated - 1:]
        seqs.append(seq)
    logits = torch.randn(len(seqs), TOKENS.vocab_size, generator=gen)
    logits[:, 9] += 10.0  # a begin-suppressed token that would otherwise win
    twins = copy.deepcopy(seqs)
    assert engine.rules.choose(logits, seqs, engine.sample).tolist() == per_row_choose(engine, logits, twins)
    assert [s.state for s in seqs] == [s.state for s in twins]


def test_choice_of_a_step_launched_ahead_masks_its_first_text_token() -> None:
    """``lead`` 1: each row chooses the token after the one the host is reading back, so the
    begin-suppress mask falls one step earlier in the host's count."""
    engine = make_engine(tiny_model(), False)
    seqs = []
    for generated, detect in [(0, False), (1, False), (2, True), (3, True), (5, True)]:
        seq = engine._new_sequence(f"r{generated}", [SOT], {"detect_language": detect,
                                                            "sampling": {"temperature": 0.0}})
        seq.tokens += [5] * generated
        seqs.append(seq)
    logits = torch.randn(len(seqs), TOKENS.vocab_size, generator=torch.Generator().manual_seed(0))
    logits[:, 9] += 100.0  # begin-suppressed only: wins unless this is a first text token
    ahead = engine.rules.choose(logits, seqs, engine.sample, lead=1).tolist()
    for seq in seqs:
        seq.tokens.append(5)
    assert ahead == per_row_choose(engine, logits, seqs)
    assert [t == 9 for t in ahead] == [True, True, False, True, True]


# ------------------------------------------------------------------ through a deployment
def deployment_tokens(model_dir, device: str, dtype: str, model_kwargs: dict, clips: int = 4,
                      new_tokens: int = 12, seed: int = 0) -> list[list[int]]:
    """Every clip's token ids from an in-process ``whisper`` deployment (dummy weights) with
    ``model_kwargs``: random audio, requests built by the model's own ``window_request``, a mix
    of a given language and detection, transcribe and translate, all submitted at once."""
    import threading

    from mstar.config import parse_config
    from mstar.runtime.launch import start

    config = parse_config({
        "model": "whisper", "model_path": str(model_dir), "load_format": "dummy", "device": device,
        "dtype": dtype, "max_concurrent_requests": clips,
        "resources": {"kv_cache": {"max_num_pages": clips * 8, "page_size": 16}},
        "model_kwargs": {"max_new_tokens": new_tokens, "seed": seed, **model_kwargs}})
    deployment = start(config, in_process=True)
    try:
        gen = torch.Generator().manual_seed(seed)
        outs = []
        modes = [("en", "transcribe"), (None, "transcribe"), ("fr", "translate"), (None, "translate")]
        for i in range(clips):
            language, task = modes[i % 4]
            samples = 0.1 * torch.randn(16000 * (5 + 3 * i), generator=gen)
            request = deployment.spec.window_request(samples, language, task, None, 0.0, seed)
            done, ids = threading.Event(), []

            def sink(event, ids=ids, done=done) -> None:
                if event is None:
                    done.set()
                elif event.error:
                    ids.append(event.error)
                else:
                    ids.extend(event.token_ids)

            deployment.runtime.submit(f"clip-{i}", request, deployment.spec.output_stream(request, []), sink)
            outs.append((done, ids))
        for done, _ in outs:
            assert done.wait(300), "a clip did not finish"
        return [ids for _, ids in outs]
    finally:
        deployment.close()


def test_deployment_with_overlap_matches_eager(tmp_path) -> None:
    from benchmarks.common import WHISPER_TINY, whisper_dir

    model_dir = whisper_dir(tmp_path, **WHISPER_TINY)
    want = deployment_tokens(model_dir, "cpu", "float32", {})
    assert all(ids and all(isinstance(t, int) for t in ids) for ids in want), want
    assert deployment_tokens(model_dir, "cpu", "float32", {"overlap_scheduling": True}) == want
