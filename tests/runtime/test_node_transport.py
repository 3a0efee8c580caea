"""The ``shm+tcp`` transport of ranks spread over nodes: shared memory to the ranks of its
own node, TCP to the others, chosen per peer from the node named in its address."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mstar.runtime.transport import make_transport
from mstar.runtime.transport.nodes import NodeAwareTransport, parse_address

WAIT_S = 10.0


def _recv(t: NodeAwareTransport, n: int) -> list:
    out: list = []
    deadline = time.monotonic() + WAIT_S
    while len(out) < n and time.monotonic() < deadline:
        out += t.recv(0.2)
    return out


@pytest.fixture
def ranks():
    nodes = {0: "node-a", 1: "node-a", 2: "node-b"}
    transports = {r: make_transport("shm+tcp", r, node=node) for r, node in nodes.items()}
    addresses = {r: t.address for r, t in transports.items()}
    for t in transports.values():
        t.connect(addresses)
    yield transports
    for t in transports.values():
        t.close()


def test_the_route_follows_the_node(ranks) -> None:
    assert ranks[0].via(1) == ranks[1].via(0) == "shm"
    assert ranks[0].via(2) == ranks[2].via(1) == "tcp"
    node, shm, tcp = parse_address(ranks[2].address)
    assert node == "node-b" and tcp.startswith("tcp://127.0.0.1:") and shm != tcp


def test_every_pair_delivers_in_order(ranks) -> None:
    sent = {}
    for src, t in ranks.items():
        for dst in ranks:
            for i in range(3):
                tensors = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3) * (10 * src + dst) + i,
                           "big": torch.full((300_000,), float(src))}
                sent[(src, dst, i)] = tensors
                t.send(dst, f"{src}->{dst}#{i}", tensors)
    for dst, t in ranks.items():
        got = _recv(t, 3 * len(ranks))
        assert len(got) == 3 * len(ranks)
        for src in ranks:
            keys = [key for key, _ in got if key.startswith(f"{src}->")]
            assert keys == [f"{src}->{dst}#{i}" for i in range(3)]  # one pair keeps its order
        for key, tensors in got:
            src, i = int(key.split("->")[0]), int(key.rsplit("#")[1])
            assert all(torch.equal(tensors[k], v) for k, v in sent[(src, dst, i)].items())


def test_a_blocked_recv_wakes_for_either_route_and_on_close(ranks) -> None:
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(ranks[0].recv(WAIT_S)))
    reader.start()
    time.sleep(0.1)
    ranks[2].send(0, "far", {"x": torch.ones(2)})
    reader.join(WAIT_S)
    assert [key for key, _ in got] == ["far"]
    reader = threading.Thread(target=lambda: got.extend(ranks[0].recv(None)))
    reader.start()
    ranks[0].close()
    reader.join(WAIT_S)
    assert not reader.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        ranks[0].recv(0)


def test_bad_addresses_and_nodes_are_refused() -> None:
    with pytest.raises(ValueError, match="nodes://"):
        parse_address("tcp://127.0.0.1:5000")
    with pytest.raises(ValueError, match="name of its node"):
        make_transport("shm+tcp", 0)
    with pytest.raises(ValueError, match="'|'"):
        NodeAwareTransport(0, node="a|b", host="127.0.0.1")
