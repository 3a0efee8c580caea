"""The transport of ranks spread over several machines: shared memory to the peers of
one's own node, TCP to the others, chosen per peer from the addresses they publish.

Each rank listens twice, on a shared-memory transport and on a TCP one bound to its node's
address, and publishes both with its node's name as one address,
``nodes://<node>|<shm address>|<tcp address>``. ``connect`` sends to a peer of the same
node over shared memory and to any other over TCP; ``recv`` returns what came on either.
A pair of ranks always talks over one of the two, so messages between them keep their
order.
"""

from __future__ import annotations

import math
import threading
import time

import torch
import zmq

from mstar.runtime.transport.base import Message, TensorTransport
from mstar.runtime.transport.shm import ShmTransport
from mstar.runtime.transport.tcp import TcpTransport

__all__ = ["NodeAwareTransport", "parse_address"]

_SCHEME = "nodes://"


def parse_address(address: str) -> tuple[str, str, str]:
    """``(node, shm address, tcp address)`` of a ``nodes://`` address."""
    if not address.startswith(_SCHEME) or address.count("|") != 2:
        raise ValueError(f"not a nodes:// address: {address!r}")
    node, shm, tcp = address[len(_SCHEME):].split("|")
    return node, shm, tcp


class NodeAwareTransport(TensorTransport):
    """Shared memory within ``node``, TCP (bound on ``host``) to other nodes (module doc)."""

    def __init__(self, rank: int, *, node: str, host: str, ctx: zmq.Context | None = None) -> None:
        if "|" in node:
            raise ValueError(f"a node name may not contain '|': {node!r}")
        self.rank = rank
        self.node = node
        self._shm = ShmTransport(rank, ctx=ctx)
        try:
            self._tcp = TcpTransport(rank, host=host, ctx=ctx)
        except BaseException:
            self._shm.close()
            raise
        self._route: dict[int, TensorTransport] = {}
        self._recv_lock = threading.Lock()  # ``close`` waits for a blocked ``recv`` (within 50 ms)
        self._closed = False

    @property
    def address(self) -> str:
        return f"{_SCHEME}{self.node}|{self._shm.address}|{self._tcp.address}"

    def connect(self, peers: dict[int, str]) -> None:
        near, far = {}, {}
        for peer, address in peers.items():
            if peer == self.rank:
                continue
            node, shm, tcp = parse_address(address)
            (near if node == self.node else far)[peer] = shm if node == self.node else tcp
        self._shm.connect(near)
        self._tcp.connect(far)
        self._route.update({peer: self._shm for peer in near} | {peer: self._tcp for peer in far})

    def via(self, peer: int) -> str:
        """``"shm"`` or ``"tcp"``: how messages to ``peer`` travel."""
        return "shm" if self._route[peer] is self._shm else "tcp"

    def send(self, dst: int, key: str, tensors: dict[str, torch.Tensor]) -> None:
        if dst == self.rank:
            self._shm.send(dst, key, tensors)
            return
        route = self._route.get(dst)
        if route is None:
            raise KeyError(f"rank {self.rank}: destination rank {dst} is not connected")
        route.send(dst, key, tensors)

    def recv(self, timeout: float | None = 0.0) -> list[Message]:
        if self._closed:
            raise RuntimeError(f"transport of rank {self.rank} is closed")
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._recv_lock:
            poller = zmq.Poller()
            for sub in (self._shm, self._tcp):
                poller.register(sub.pull_socket, zmq.POLLIN)
            while not self._closed:
                out = self._shm.recv(0) + self._tcp.recv(0)
                if out:
                    return out
                wait = 0.05  # at most: a self-send from another thread lands in a queue, not a socket
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return out
                    wait = min(wait, remaining)
                poller.poll(max(1, math.ceil(wait * 1000)))
            return []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # wakes a blocked recv within 50 ms
        with self._recv_lock:
            self._shm.close()
            self._tcp.close()
