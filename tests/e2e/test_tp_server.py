"""``mstar serve`` with the Llama node split over two worker processes (TP=2, gloo on the
CPU) answers a greedy chat exactly as the TP=1 deployment of the same checkpoint does,
with the tensors of the frontend and the workers over shared memory and over TCP
(``--tensor-comm-protocol``). The TP=1 answer comes from the same app over an in-process
deployment. The same checks run on two GPUs (``cuda``: NCCL between the TP ranks, the TP=1
deployment on GPU 0; skipped without them), in float32 without TF32."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from live_server import launch_server

from mstar.config import parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.distributed.helpers import devices, fp32_only
from tests.distributed.test_tp_runtime import TP2, write_tiny_llama

BODY = {"model": "llama", "messages": [{"role": "user", "content": "Where is the bridge?"}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _config(model_dir: Path, node_groups: list[dict], device: str) -> dict:
    return {"model": "llama", "model_path": str(model_dir), "device": device, "dtype": "float32",
            "max_seq_len": 128, "max_concurrent_requests": 4, "node_groups": node_groups,
            "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 16}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tp_server_model"))


@pytest.fixture(scope="module", params=devices(2))
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tp1_answer(model_dir, device) -> dict:
    with fp32_only(device):
        deployment = start(parse_config(_config(model_dir, [], device)), in_process=True)
        try:
            with TestClient(create_app(deployment.backend)) as client:
                response = client.post("/v1/chat/completions", json=BODY)
        finally:
            deployment.close()
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("protocol", ["SHM", "TCP"])
def test_tp2_server_answers_as_tp1(model_dir, device, tp1_answer, tmp_path, protocol):
    expected = tp1_answer["choices"][0]["message"]["content"]
    assert tp1_answer["usage"]["completion_tokens"] == BODY["max_tokens"] and expected
    config = tmp_path / "llama_tp2.yaml"
    config.write_text(yaml.safe_dump(_config(model_dir, TP2, device)))
    with fp32_only(device), launch_server("llama", tmp_path, ["--config", str(config), "--tensor-comm-protocol",
                                                               protocol]) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for _ in range(2):  # the second runs on the KV pages the first gave back
                response = client.post("/v1/chat/completions", json=BODY)
                assert response.status_code == 200, f"{response.text}\n{server.log_tail()}"
                answer = response.json()
                assert answer["choices"][0]["message"]["content"] == expected
                assert answer["usage"] == tp1_answer["usage"]
            assert client.get("/health").status_code == 200
