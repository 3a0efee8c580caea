"""KV hand-off between two autoregressive engines (disaggregated prefill/decode): a request
prefilled by a ``PrefillEngine`` and adopted by a decoder (``export_kv`` -> ``import_kv``)
must see the logits and tokens the decoder sees when it prefills the request itself, with
its pages freed on the prefill side at once and on the decode side at release, and every
failure leaving both pools as they were."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import tiny_llama_dir
from mstar.config import parse_config
from mstar.engine.autoregressive import PrefillEngine
from mstar.engine.base import EngineItem
from mstar.engine.page_pool import OutOfPages
from mstar.model.llama.model import LLM, LLM_PREFILL, LlamaChat

PAGE_SIZE = 4
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8]  # 11 tokens: 3 pages, the last one partly used
STEPS = 8
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 1.0, "seed": 1234}


def _config(path: str, pages: int = 64) -> dict:
    return {"model": "llama", "model_path": path, "load_format": "dummy", "device": "cpu", "dtype": "float32",
            "max_seq_len": 64, "max_concurrent_requests": 4,
            "node_groups": [{"node_names": [LLM_PREFILL], "ranks": [0]}, {"node_names": [LLM], "ranks": [1]}],
            "resources": {"kv_cache": {"max_num_pages": pages, "page_size": PAGE_SIZE}}}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return str(tiny_llama_dir(tmp_path_factory.mktemp("kv")))


@pytest.fixture(scope="module")
def engines(llama_dir):
    """The prefill and decode engines over one model (as on one rank)."""
    spec = LlamaChat(parse_config(_config(llama_dir), "test"))
    return spec.build_engines({LLM, LLM_PREFILL}, torch.device("cpu"))


@pytest.fixture(autouse=True)
def _pools_drained(engines):
    yield
    for engine in (engines[LLM], engines[LLM_PREFILL].engine):
        for request_id in list(engine.seqs) + engine.pool.seq_ids():
            engine.release(request_id)


def _params(sampling: dict, max_new: int = 50) -> dict:
    return {"sampling": sampling, "max_new_tokens": max_new, "stop_token_ids": []}


def _prefill(rid: str, params: dict) -> EngineItem:
    return EngineItem(rid, "prefill", 0, {"prompt_ids": torch.tensor(PROMPT)}, params)


def _decode(rid: str, token: torch.Tensor, params: dict, handoff: dict | None = None) -> EngineItem:
    inputs = {"token": token}
    if handoff is not None:  # what the chat_pd walk's decode step reads
        inputs |= {"prompt_ids": torch.tensor(PROMPT), **handoff}
    return EngineItem(rid, "decode", 0, inputs, params)


class _Logits:
    """Records the last-position logits every step of an engine chose from."""

    def __init__(self, engine):
        self.rows: list[torch.Tensor] = []
        self.rules = engine.rules
        self.original = engine.rules.choose

    def __enter__(self):
        def choose(logits, seqs, sample, lead=0):
            self.rows.append(logits.clone())
            return self.original(logits, seqs, sample, lead)

        self.rules.choose = choose
        return self

    def __exit__(self, *exc):
        del self.rules.choose


def _colocated(engine, rid: str, params: dict) -> tuple[list[int], list[torch.Tensor]]:
    with _Logits(engine) as seen:
        out = engine.run([_prefill(rid, params)])[0]
        tokens = [int(out.outputs["token"])]
        for _ in range(STEPS):
            out = engine.run([_decode(rid, out.outputs["token"], params)])[0]
            tokens.append(int(out.outputs["token"]))
    engine.release(rid)
    return tokens, seen.rows


def _disaggregated(prefiller, decoder, rid: str, params: dict, *, move_rng: bool = True):
    with _Logits(prefiller.engine) as first, _Logits(decoder) as rest:
        out = prefiller.run([_prefill(rid, params)])[0]
        assert prefiller.engine.pool.num_used_pages == 0 and rid not in prefiller.engine.seqs  # freed at once
        handoff = {"kv": out.outputs["kv"], "rng": out.outputs["rng"] if move_rng else torch.empty(0)}
        tokens = [int(out.outputs["token"])]
        out = decoder.run([_decode(rid, out.outputs["token"], params, handoff)])[0]
        tokens.append(int(out.outputs["token"]))
        for _ in range(STEPS - 1):  # later decodes read the same hand-off again; it is ignored
            out = decoder.run([_decode(rid, out.outputs["token"], params, handoff)])[0]
            tokens.append(int(out.outputs["token"]))
    return tokens, first.rows + rest.rows


def test_engines_share_the_model_and_own_their_pools(engines):
    assert isinstance(engines[LLM_PREFILL], PrefillEngine) and not isinstance(engines[LLM], PrefillEngine)
    decoder, prefiller = engines[LLM], engines[LLM_PREFILL].engine
    assert decoder.model is prefiller.model
    assert decoder.pool is not prefiller.pool
    assert decoder.kv_caches[0].data_ptr() != prefiller.kv_caches[0].data_ptr()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_adopted_request_decodes_like_the_colocated_one(engines, sampling):
    decoder, prefiller = engines[LLM], engines[LLM_PREFILL]
    params = _params(sampling)
    want_tokens, want_logits = _colocated(decoder, "ref", params)
    got_tokens, got_logits = _disaggregated(prefiller, decoder, "pd", params)
    assert got_tokens == want_tokens
    assert len(got_logits) == len(want_logits) == STEPS + 1
    for step, (got, want) in enumerate(zip(got_logits, want_logits)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"logits differ at step {step}")
    seq = decoder.seqs["pd"]
    assert seq.tokens == PROMPT + want_tokens and seq.prompt_len == len(PROMPT) and seq.generated == STEPS + 1
    assert decoder.pool.seq_len("pd") == len(PROMPT) + STEPS
    decoder.release("pd")
    assert decoder.pool.num_used_pages == 0 and prefiller.engine.pool.num_used_pages == 0
    decoder.pool.check_invariants()
    prefiller.engine.pool.check_invariants()


def test_the_sampler_state_must_move_with_the_request(engines):
    # Without the generator state, the decoder restarts the seeded stream: another sample.
    decoder, prefiller = engines[LLM], engines[LLM_PREFILL]
    params = _params(SEEDED)
    want, _ = _colocated(decoder, "ref", params)
    got, _ = _disaggregated(prefiller, decoder, "pd", params, move_rng=False)
    assert got[0] == want[0] and got != want


def test_export_import_round_trip_lands_in_other_pages(engines):
    decoder = engines[LLM]
    decoder.pool.reserve("filler", 3 * PAGE_SIZE)  # the adopted request gets pages other than the prefill's
    params = _params(GREEDY)
    torch.manual_seed(0)
    kv = torch.randn(2, 2, len(PROMPT), *decoder.kv_caches[0].shape[-2:])
    seq = decoder.import_kv("x", kv, PROMPT + [1], prompt_len=len(PROMPT), params=params)
    assert seq.computed == len(PROMPT) and seq.generated == 1
    assert decoder.pool.page_table("x")[0] >= 3 and decoder.pool.seq_len("x") == len(PROMPT)
    assert torch.equal(decoder.export_kv("x"), kv)
    assert decoder.generator_state("x").numel() == 0  # greedy: no generator


def test_request_that_ends_at_its_first_token_hands_nothing_off(engines):
    prefiller = engines[LLM_PREFILL]
    out = prefiller.run([_prefill("one", _params(GREEDY, max_new=1))])[0]
    assert "stop" in out.flags and out.finish_reason == "length"
    assert set(out.outputs) == {"token"}  # kv and rng silent: no decode follows
    assert prefiller.engine.pool.num_used_pages == 0 and not prefiller.engine.seqs


def test_prefill_engine_refuses_decodes(engines):
    with pytest.raises(ValueError, match="no op 'decode'"):
        engines[LLM_PREFILL].run([_decode("d", torch.tensor([1]), _params(GREEDY))])


def test_a_failed_export_frees_the_prefill_pages(engines, monkeypatch):
    prefiller = engines[LLM_PREFILL]

    def broken(request_id):
        raise RuntimeError("export failed")

    monkeypatch.setattr(prefiller.engine, "export_kv", broken)
    with pytest.raises(RuntimeError, match="export failed"):
        prefiller.run([_prefill("a", _params(GREEDY)), _prefill("b", _params(GREEDY))])
    assert prefiller.engine.pool.num_used_pages == 0 and not prefiller.engine.seqs


@pytest.mark.parametrize("shape, match", [
    ((2, 2, 11, 2), "does not fit this cache"),       # a dimension missing
    ((3, 2, 11, 2, 16), "does not fit this cache"),    # another model's layer count
    ((2, 2, 12, 2, 16), "can continue"),               # K/V for the token the decode step computes
])
def test_import_refuses_kv_that_does_not_fit(engines, shape, match):
    decoder = engines[LLM]
    with pytest.raises(ValueError, match=match):
        decoder.import_kv("bad", torch.zeros(shape), PROMPT + [1], prompt_len=len(PROMPT), params=_params(GREEDY))
    assert "bad" not in decoder.seqs and not decoder.pool.has("bad")


def test_import_twice_and_decode_with_a_bad_handoff_fail_cleanly(engines):
    decoder = engines[LLM]
    kv = torch.zeros(2, 2, len(PROMPT), *decoder.kv_caches[0].shape[-2:])
    decoder.import_kv("twice", kv, PROMPT + [1], prompt_len=len(PROMPT), params=_params(GREEDY))
    used = decoder.pool.num_used_pages
    with pytest.raises(RuntimeError, match="already holds"):
        decoder.import_kv("twice", kv, PROMPT + [1], prompt_len=len(PROMPT), params=_params(GREEDY))
    assert decoder.pool.num_used_pages == used
    # Through run: the failed first contact leaves nothing behind (the worker then fails it alone).
    with pytest.raises(ValueError, match="does not fit"):
        decoder.run([_decode("broken", torch.tensor([1]), _params(GREEDY), {"kv": kv[:1], "rng": torch.empty(0)})])
    assert "broken" not in decoder.seqs and not decoder.pool.has("broken")
    assert decoder.pool.num_used_pages == used


def test_import_into_a_full_pool_leaves_it_unchanged(llama_dir):
    spec = LlamaChat(parse_config(_config(llama_dir, pages=4), "test"))
    decoder = spec.build_engines({LLM}, torch.device("cpu"))[LLM]
    decoder.pool.reserve("other", 2 * PAGE_SIZE)
    kv = torch.zeros(2, 2, len(PROMPT), *decoder.kv_caches[0].shape[-2:])
    with pytest.raises(OutOfPages):
        decoder.import_kv("late", kv, PROMPT + [1], prompt_len=len(PROMPT), params=_params(GREEDY))
    assert "late" not in decoder.seqs and decoder.pool.num_used_pages == 2
    decoder.pool.check_invariants()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_an_adoption_the_pool_has_no_room_for_waits_and_recomputes(engines, llama_dir, sampling):
    """A decoder whose pool is full takes a request in without its K/V (as if preempted): it
    waits for pages, then recomputes its history and decodes as the colocated one does."""
    prefiller = engines[LLM_PREFILL]
    params = _params(sampling, max_new=STEPS)
    want = _colocated(engines[LLM], "ref", params)[0][:STEPS]  # it ran past the budget
    spec = LlamaChat(parse_config(_config(llama_dir, pages=5), "test"))
    decoder = spec.build_engines({LLM}, torch.device("cpu"))[LLM]
    outs = prefiller.run([_prefill("a", params), _prefill("b", params)])
    handoff = {rid: {"kv": o.outputs["kv"], "rng": o.outputs["rng"]} for rid, o in zip("ab", outs)}
    tokens = {rid: [int(o.outputs["token"])] for rid, o in zip("ab", outs)}
    pending = {rid: _decode(rid, o.outputs["token"], params, handoff[rid]) for rid, o in zip("ab", outs)}
    waited = 0
    while pending:
        items = list(pending.values())
        for item, out in zip(items, decoder.run(items)):
            if out.preempted:
                waited += 1
                continue
            tokens[item.request_id].append(int(out.outputs["token"]))
            if "stop" in out.flags:
                del pending[item.request_id]
                decoder.release(item.request_id)
            else:
                pending[item.request_id] = _decode(item.request_id, out.outputs["token"], params,
                                                   handoff[item.request_id])
    assert waited > 0  # b's 3 pages of K/V did not fit beside a's
    assert tokens == {"a": want, "b": want}
    decoder.pool.check_invariants()
    assert decoder.pool.num_used_pages == 0
