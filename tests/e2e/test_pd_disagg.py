"""Disaggregated prefill/decode through the HTTP server: a tiny dummy-weight Llama with
``llm_prefill`` on rank 0 and ``llm`` on rank 1 (the prompt's KV pages move between the two
worker processes over SHM or TCP) answers exactly what the colocated deployment answers for
the same requests, greedy and seeded, plain and streamed, and leaves every KV page of both
pools free. The HTTP checks run on two GPUs too (``cuda``: colocated on GPU 0, prefill on
GPU 0 and decode on GPU 1, the pages crossing through host memory; skipped without them),
in float32 without TF32. In process: both nodes on one rank, and the example configs."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from inprocess import poll_drained
from live_server import Server, launch_server

from benchmarks.common import tiny_llama_dir
from mstar.config import load_config, parse_config
from mstar.contract import ChatSpec, SamplingParams
from mstar.model.llama.model import LLM, LLM_PREFILL, LlamaChat
from mstar.runtime.launch import start
from mstar.runtime.placement import build_placement
from tests.distributed.helpers import devices, fp32_only

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
COLOCATED = [{"node_names": [LLM], "ranks": [0]}]
DISAGGREGATED = [{"node_names": [LLM_PREFILL], "ranks": [0]}, {"node_names": [LLM], "ranks": [1]}]
QUESTIONS = ["Where do the pages go?", "A longer question, so that its prompt fills several KV pages of the pool."]
REQUEST_TIMEOUT_S = 120.0


def _checkpoint(path: Path) -> Path:
    """The tiny Llama's directory, its tokenizer given a chat template."""
    tiny_llama_dir(path)
    tok_config = path / "tokenizer_config.json"
    data = json.loads(tok_config.read_text())
    data["chat_template"] = TEMPLATE
    tok_config.write_text(json.dumps(data))
    return path


def _deployment(checkpoint: Path, node_groups: list[dict], device: str = "cpu") -> dict:
    return {"model": "llama", "model_path": str(checkpoint), "load_format": "dummy", "device": device,
            "dtype": "float32", "max_seq_len": 256, "max_concurrent_requests": 4, "node_groups": node_groups,
            "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 4}}}


# ------------------------------------------------------------------ HTTP servers
@pytest.fixture(scope="module", params=devices(2))
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def servers(tmp_path_factory, device) -> dict[str, Server]:
    """The colocated deployment and the disaggregated one over SHM and over TCP, started
    side by side (startup is most of this module's time)."""
    with fp32_only(device):  # the servers' worker processes inherit the environment
        yield from _servers(tmp_path_factory, device)


def _servers(tmp_path_factory, device: str):
    checkpoint = _checkpoint(tmp_path_factory.mktemp("pd-llama"))
    layouts = {"colocated": (COLOCATED, "SHM"), "pd-shm": (DISAGGREGATED, "SHM"), "pd-tcp": (DISAGGREGATED, "TCP")}
    running = []  # the launch_server contexts entered, each stopped when the module ends

    def start(name: str) -> Server:
        groups, protocol = layouts[name]
        work = tmp_path_factory.mktemp(name)
        (work / "deploy.yaml").write_text(json.dumps(_deployment(checkpoint, groups, device)))
        context = launch_server("llama", work, ["--config", str(work / "deploy.yaml"),
                                                "--tensor-comm-protocol", protocol])
        server = context.__enter__()
        running.append(context)
        return server

    try:
        with ThreadPoolExecutor(len(layouts)) as pool:
            started = dict(zip(layouts, pool.map(start, layouts)))
        yield started
    finally:
        with ThreadPoolExecutor(len(layouts)) as pool:  # stopping takes seconds each: side by side too
            list(pool.map(lambda context: context.__exit__(None, None, None), running))


def _chat(server: Server, question: str, sampling: dict, stream: bool = False) -> tuple[str, str]:
    body = {"model": "llama", "messages": [{"role": "user", "content": question}], "max_tokens": 24,
            "ignore_eos": True, "stream": stream, **sampling}
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        if not stream:
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            return choice["message"]["content"], choice["finish_reason"]
        text, reason = [], None
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                data = line[len("data:"):].strip() if line.startswith("data:") else ""
                if data and data != "[DONE]":
                    choice = json.loads(data)["choices"][0] if json.loads(data)["choices"] else {}
                    text.append(choice.get("delta", {}).get("content") or "")
                    reason = choice.get("finish_reason") or reason
        return "".join(text), reason


def _pages_used(server: Server) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    pattern = r'^mstar_kv_pages_used\{(?=[^}]*rank="(\d+)")(?=[^}]*node="(\w+)")[^}]*\} (\S+)$'
    return {(rank, node): float(value) for rank, node, value in re.findall(pattern, text, re.M)}


def _wait_pages_free(server: Server) -> dict[tuple[str, str], float]:
    deadline = time.monotonic() + 20
    while True:
        used = _pages_used(server)
        if (used and not any(used.values())) or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.0, "top_p": 0.95, "seed": 1234}}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_disaggregated_answers_like_colocated(servers, sampling, stream):
    for question in QUESTIONS:
        want = _chat(servers["colocated"], question, SAMPLINGS[sampling], stream)
        assert want[0] and want[1] == "length"
        for name in ("pd-shm", "pd-tcp"):
            assert _chat(servers[name], question, SAMPLINGS[sampling], stream) == want, (name, question)


def test_seeded_sampling_is_not_greedy(servers):
    greedy = _chat(servers["pd-shm"], QUESTIONS[0], SAMPLINGS["greedy"])
    assert _chat(servers["pd-shm"], QUESTIONS[0], SAMPLINGS["seeded"]) != greedy


def test_pages_of_both_pools_are_free_afterwards(servers):
    for name in ("pd-shm", "pd-tcp"):
        _chat(servers[name], QUESTIONS[1], SAMPLINGS["greedy"])
        used = _wait_pages_free(servers[name])
        assert set(used) == {("0", LLM_PREFILL), ("1", LLM)}, used  # one pool per rank and node
        assert not any(used.values()), (name, used)


# ------------------------------------------------------------------- in process
def _in_process_answers(checkpoint: Path, node_groups: list[dict]) -> tuple[list[tuple[str, list[int]]], dict]:
    """(walk, token ids) of every question and sampling, asked one after another, and the
    KV pages each node's pool still holds once the deployment is drained."""
    config = parse_config(_deployment(checkpoint, node_groups), "test")
    deployment = start(config, in_process=True)
    try:
        engines = deployment.runtime.workers.workers[0].engines
        answers = []
        for i, (question, sampling) in enumerate(itertools.product(QUESTIONS, SAMPLINGS.values())):
            chat = ChatSpec(f"q{i}", [{"role": "user", "content": question}], SamplingParams(**sampling), 12,
                            ignore_eos=True)
            answers.append((deployment.spec.prepare_chat(chat).walk, asyncio.run(_token_ids(deployment, chat))))
        def pages() -> dict[str, float]:  # a PrefillEngine holds its pool in its engine: read the gauges
            return {node: engine.stats()["kv_pages_used"] for node, engine in engines.items()}

        poll_drained(deployment, engines[LLM], also=lambda: not any(pages().values()))
        return answers, pages()
    finally:
        deployment.close()


async def _token_ids(deployment, chat) -> list[int]:
    ids = []
    events = deployment.backend.chat(chat)
    try:
        async for event in events:
            ids += event.token_ids
    finally:
        await events.aclose()
    return ids


def test_both_nodes_on_one_rank(tmp_path):
    checkpoint = _checkpoint(tmp_path)
    want, _ = _in_process_answers(checkpoint, COLOCATED)
    got, pages = _in_process_answers(checkpoint, [{"node_names": [LLM_PREFILL, LLM], "ranks": [0]}])
    assert {walk for walk, _ in want} == {"chat"} and {walk for walk, _ in got} == {"chat_pd"}
    assert all(len(ids) == 12 for _, ids in want)
    assert [ids for _, ids in got] == [ids for _, ids in want]
    assert pages == {LLM: 0, LLM_PREFILL: 0}


# --------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", ["smollm2_pd_disagg.yaml", "llama_pd_disagg.yaml"])
def test_example_configs_route_chats_through_chat_pd(name):
    config = load_config(CONFIGS / name)
    spec = LlamaChat(config)
    assert spec.disaggregated
    graph = spec.graph()
    config = config.model_copy(update={"device": "cpu"})  # the cuda example on a machine without GPUs
    placement = build_placement(graph, config)
    assert placement.rank_of("chat_pd", LLM_PREFILL) == 0 and placement.rank_of("chat_pd", LLM) == 1
    assert placement.nodes_on(0) == {LLM_PREFILL} and placement.nodes_on(1) == {LLM}


def test_colocated_configs_keep_the_chat_walk():
    spec = LlamaChat(load_config(CONFIGS / "smollm2.yaml"))
    assert not spec.disaggregated and set(spec.graph().walks) == {"chat"}
