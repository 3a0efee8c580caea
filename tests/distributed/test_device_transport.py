"""Tensors on a GPU cross ranks through host memory: every tensor transport (in-process,
shared memory, TCP) and a split group's lockstep channel take a CUDA tensor, copy it to the
host, and hand the receiver a contiguous CPU tensor of the same dtype, shape and values,
which the receiving engine moves to its own device (a KV hand-off lands in the decode
engine's cache on another GPU). Each check also runs with CPU tensors (``cpu``); the
``cuda`` ones are skipped without the GPUs."""

from __future__ import annotations

import time

import pytest
import torch

from mstar.engine.base import EngineItem
from mstar.runtime.lockstep import decode_run, encode_run
from mstar.runtime.transport import make_transport
from mstar.runtime.transport.inproc import InProcessHub
from tests.distributed.helpers import devices, rank_device


def _tensors(device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "kv": torch.randn(2, 2, 5, 3, 8, generator=gen).to(device),  # [layers, 2, tokens, heads, dim]
        "half": torch.randn(4, 6, generator=gen).to(device, torch.bfloat16).t(),  # not contiguous
        "token": torch.tensor([17], device=device),
        "empty": torch.empty(0, 4, device=device),
    }


def _received(receiver, timeout: float = 10.0) -> tuple[str, dict[str, torch.Tensor]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        messages = receiver.recv(timeout=0.5)
        if messages:
            (message,) = messages
            return message
    raise AssertionError("no message arrived")


@pytest.mark.parametrize("device", devices(1))
@pytest.mark.parametrize("protocol", ["inproc", "shm", "tcp"])
def test_tensors_cross_every_transport_through_host_memory(protocol, device):
    sent = _tensors(rank_device(device, 0))
    hub = InProcessHub() if protocol == "inproc" else None
    sender, receiver = (make_transport(protocol, rank, hub=hub) for rank in (0, 1))
    try:
        sender.connect({1: receiver.address})
        sender.send(1, "r1/kv/0", sent)
        key, got = _received(receiver)
    finally:
        sender.close()
        receiver.close()
    assert key == "r1/kv/0" and set(got) == set(sent)
    for name, value in got.items():
        assert value.device.type == "cpu" and value.is_contiguous(), name
        assert value.dtype == sent[name].dtype and value.shape == sent[name].shape, name
        assert torch.equal(value, sent[name].cpu()), name


@pytest.mark.parametrize("device", devices(1))
def test_inputs_of_a_split_groups_call_reach_the_followers_on_the_host(device):
    inputs = _tensors(rank_device(device, 0))
    items = [EngineItem("r1", "decode", 3, inputs, {"max_new_tokens": 4})]
    message, tensors = encode_run("llm", items)
    data = torch.cat([t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    (item,) = decode_run(message, data)
    assert (item.request_id, item.op, item.iteration, item.params) == ("r1", "decode", 3, {"max_new_tokens": 4})
    for name, value in inputs.items():
        assert item.inputs[name].device.type == "cpu"
        assert torch.equal(item.inputs[name], value.cpu()), name


@pytest.mark.parametrize("device", devices(2))
def test_kv_exported_on_one_gpu_lands_in_a_decode_engine_on_another(tmp_path, device):
    """What a disaggregated deployment does: the prefill engine on GPU 0 exports a prompt's
    K/V, the transport brings it to the host, and the decode engine on GPU 1 adopts it and
    decodes the same token the prefill engine's own next step gives."""
    from benchmarks.common import tiny_llama_dir
    from mstar.config import parse_config
    from mstar.model.llama.model import LLM, LLM_PREFILL, LlamaChat

    folder = tiny_llama_dir(tmp_path)
    config = parse_config({"model": "llama", "model_path": str(folder), "load_format": "dummy",
                           "device": device, "dtype": "float32", "max_seq_len": 64,
                           "resources": {"kv_cache": {"max_num_pages": 16, "page_size": 4}}})
    gpu0, gpu1 = rank_device(device, 0), rank_device(device, 1)
    prefill = LlamaChat(config).build_engines({LLM_PREFILL}, gpu0)[LLM_PREFILL]
    colocated = LlamaChat(config).build_engines({LLM}, gpu0)[LLM]
    decode = LlamaChat(config).build_engines({LLM}, gpu1)[LLM]
    prompt = torch.tensor([5, 9, 300, 17, 2, 44, 8])
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": 4}
    [handoff] = prefill.run([EngineItem("a", "prefill", 0, {"prompt_ids": prompt}, params)])
    [first] = colocated.run([EngineItem("a", "prefill", 0, {"prompt_ids": prompt}, params)])
    assert handoff.outputs["kv"].device == gpu0
    sender, receiver = (make_transport("tcp", rank) for rank in (0, 1))
    try:
        sender.connect({1: receiver.address})
        sender.send(1, "a/kv/0", {name: handoff.outputs[name] for name in ("token", "kv", "rng")})
        _, moved = _received(receiver)
    finally:
        sender.close()
        receiver.close()
    token = int(first.outputs["token"])
    assert int(moved["token"]) == token and moved["kv"].device.type == "cpu"
    inputs = {"prompt_ids": prompt, **moved}
    [adopted] = decode.run([EngineItem("a", "decode", 0, inputs, params)])
    [own] = colocated.run([EngineItem("a", "decode", 0, {"token": torch.tensor([token])}, params)])
    assert int(adopted.outputs["token"]) == int(own.outputs["token"])
    assert decode.kv_caches[0].device == gpu1 and decode.stats()["kv_pages_used"] > 0
