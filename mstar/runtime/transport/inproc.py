"""In-process transport: ranks that live in one process (threads, or one thread).

An :class:`InProcessHub` maps rank -> inbox queue. Sending clones the tensors (to
contiguous CPU memory, so the sender may reuse its buffers) and puts ``(key, tensors)``
into the destination's inbox; nothing is serialized. A plain CPU tensor takes one clone;
anything else (device memory, conjugate or negative views) goes the general way.
"""

from __future__ import annotations

import itertools
import queue
import threading

import torch

from mstar.runtime.transport.base import (
    Message,
    TensorTransport,
    check_message,
    clone_tensors,
)

__all__ = ["InProcessHub", "InProcessTransport", "default_hub"]

_HUB_IDS = itertools.count()
_DEFAULT_HUB: InProcessHub | None = None
_DEFAULT_HUB_LOCK = threading.Lock()


class InProcessHub:
    """Thread-safe registry of rank inboxes shared by all in-process transports."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"hub{next(_HUB_IDS)}"
        self._inboxes: dict[int, queue.SimpleQueue[Message]] = {}
        self._lock = threading.Lock()

    def register(self, rank: int) -> queue.SimpleQueue[Message]:
        """Create the inbox of ``rank``; a rank can be registered only once at a time."""
        with self._lock:
            if rank in self._inboxes:
                raise ValueError(f"rank {rank} is already registered in hub {self.name!r}")
            inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
            self._inboxes[rank] = inbox
            return inbox

    def unregister(self, rank: int) -> None:
        with self._lock:
            self._inboxes.pop(rank, None)

    def inbox(self, rank: int) -> queue.SimpleQueue[Message]:
        with self._lock:
            try:
                return self._inboxes[rank]
            except KeyError:
                raise KeyError(f"rank {rank} is not registered in hub {self.name!r}") from None

    def address_of(self, rank: int) -> str:
        return f"inproc://{self.name}/{rank}"


def default_hub() -> InProcessHub:
    """The process-wide hub used by ``make_transport("inproc", ...)`` without ``hub=``."""
    global _DEFAULT_HUB
    with _DEFAULT_HUB_LOCK:
        if _DEFAULT_HUB is None:
            _DEFAULT_HUB = InProcessHub("default")
        return _DEFAULT_HUB


class InProcessTransport(TensorTransport):
    """Queue-based transport between ranks of the same process."""

    def __init__(self, rank: int, hub: InProcessHub) -> None:
        self.rank = rank
        self._hub = hub
        self._inbox = hub.register(rank)
        self._peers: dict[int, queue.SimpleQueue[Message]] = {rank: self._inbox}
        self._closed = False

    @property
    def address(self) -> str:
        return self._hub.address_of(self.rank)

    def connect(self, peers: dict[int, str]) -> None:
        self._check_open()
        for peer, address in peers.items():
            if peer == self.rank:
                continue
            if address != self._hub.address_of(peer):
                raise ValueError(
                    f"address {address!r} of rank {peer} does not belong to hub {self._hub.name!r}"
                )
            self._peers[peer] = self._hub.inbox(peer)

    def send(self, dst: int, key: str, tensors: dict[str, torch.Tensor]) -> None:
        self._check_open()
        check_message(key, tensors)
        try:
            inbox = self._peers[dst]
        except KeyError:
            raise KeyError(f"rank {self.rank}: destination rank {dst} is not connected") from None
        inbox.put((key, _copies(tensors)))

    def recv(self, timeout: float | None = 0.0) -> list[Message]:
        self._check_open()
        out: list[Message] = []
        if timeout is None or timeout > 0:
            try:
                out.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._hub.unregister(self.rank)
        self._peers.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"transport of rank {self.rank} is closed")


def _copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if (tensor.device.type == "cpu" and tensor.layout == torch.strided
                and not (tensor.is_conj() or tensor.is_neg() or tensor.is_quantized)):
            out[name] = tensor.detach().clone(memory_format=torch.contiguous_format)
        else:
            out.update(clone_tensors({name: tensor}))
    return out
