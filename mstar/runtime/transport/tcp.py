"""ZeroMQ transports: shared PUSH/PULL plumbing and the TCP transport.

Every rank binds one PULL socket; it opens one PUSH socket per peer. High-water marks
are disabled (unbounded queues), so ``send`` never blocks on a slow or busy receiver.
TCP messages are multipart: ``[msgpack header, tensor bytes, tensor bytes, ...]``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Mapping

import torch
import zmq

from mstar.runtime.transport.base import (
    Message,
    MessageHeader,
    TensorTransport,
    byte_view,
    check_message,
    clone_tensors,
    decode_header,
    encode_header,
    is_fresh_copy,
    tensor_from_buffer,
    tensor_header,
    to_wire_tensor,
)

__all__ = ["TcpTransport", "ZmqTransport", "from_inline_frames", "inline_frames"]

logger = logging.getLogger(__name__)

_ZERO_COPY_MIN = 1 << 16
"""Smaller tensor frames are copied: a zero-copy frame costs pyzmq a release callback
(about 4 us a frame, against 0.5 us to copy a few KB)."""

_WAKE_S = 0.05
"""Longest single poll while waiting, so local self-sends from other threads and
``close()`` are noticed promptly by a blocking ``recv``."""


class ZmqTransport(TensorTransport):
    """Base of the ZeroMQ transports: one PULL socket per rank, one PUSH per peer.

    ``send`` may be called from several threads; ``recv`` is meant for one consumer
    thread (concurrent calls are serialized). Subclasses define the endpoint and the
    message encoding.
    """

    _LINGER_MS = 1000
    """How long ``close`` keeps trying to deliver queued outgoing messages."""

    def __init__(self, rank: int, ctx: zmq.Context | None = None) -> None:
        self.rank = rank
        self._own_ctx = ctx is None
        self._ctx: zmq.Context = zmq.Context() if ctx is None else ctx
        self._push: dict[int, tuple[str, zmq.Socket]] = {}
        self._local: deque[Message] = deque()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._closed = False
        self._pull: zmq.Socket = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        try:
            self._address = self._bind(self._pull)
        except BaseException:
            self._pull.close()
            if self._own_ctx:
                self._ctx.term()
            raise

    # ------------------------------------------------------------ subclass hooks

    @abstractmethod
    def _bind(self, sock: zmq.Socket) -> str:
        """Bind the PULL socket and return the address peers connect to."""

    @abstractmethod
    def _encode(self, key: str, tensors: Mapping[str, torch.Tensor]) -> list[zmq.Frame | bytes]:
        """Turn a message into the frames sent to a peer."""

    @abstractmethod
    def _decode(self, frames: list[zmq.Frame]) -> Message:
        """Turn received frames back into a message."""

    def _discard(self, frames: list[zmq.Frame]) -> None:
        """Release resources of a message that is dropped unread (at close)."""

    def _release(self) -> None:
        """Release subclass resources at close, after the sockets are closed."""

    # ----------------------------------------------------------------- interface

    @property
    def address(self) -> str:
        return self._address

    @property
    def pull_socket(self) -> zmq.Socket:
        """The socket messages arrive on, for a caller that polls several transports at once
        (read it through ``recv`` only)."""
        return self._pull

    def connect(self, peers: dict[int, str]) -> None:
        self._check_open()
        with self._send_lock:
            for peer, address in peers.items():
                if peer == self.rank:
                    continue
                old = self._push.get(peer)
                if old is not None:
                    if old[0] == address:
                        continue
                    old[1].close(linger=self._LINGER_MS)
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.LINGER, self._LINGER_MS)
                if address.startswith("tcp://["):
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(address)
                self._push[peer] = (address, sock)

    def send(self, dst: int, key: str, tensors: dict[str, torch.Tensor]) -> None:
        self._check_open()
        check_message(key, tensors)
        if dst == self.rank:
            self._local.append((key, clone_tensors(tensors)))
            return
        with self._send_lock:
            entry = self._push.get(dst)
            if entry is None:
                raise KeyError(f"rank {self.rank}: destination rank {dst} is not connected")
            entry[1].send_multipart(self._encode(key, tensors), copy=False)

    def recv(self, timeout: float | None = 0.0) -> list[Message]:
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._recv_lock:
            while True:
                out = self._drain()
                if out or self._closed:
                    return out
                wait = _WAKE_S
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return out
                    wait = min(wait, remaining)
                self._pull.poll(max(1, math.ceil(wait * 1000)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # wakes a blocked recv within _WAKE_S
        with self._send_lock, self._recv_lock:
            while True:
                try:
                    self._discard(self._pull.recv_multipart(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
            self._pull.close()
            for _, sock in self._push.values():
                sock.close()
            self._push.clear()
            self._local.clear()
            self._release()
        if self._own_ctx:
            self._ctx.term()

    # ------------------------------------------------------------------ helpers

    def _drain(self) -> list[Message]:
        out: list[Message] = []
        while self._local:
            out.append(self._local.popleft())
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            try:
                out.append(self._decode(frames))
            except Exception:
                logger.exception("rank %d: dropping undecodable message", self.rank)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"transport of rank {self.rank} is closed")


class TcpTransport(ZmqTransport):
    """Tensors travel inside the ZeroMQ message, one frame per tensor.

    Frames of tensors that had to be copied anyway (non-contiguous, conjugated or
    non-CPU inputs) are sent zero-copy; the caller's own memory is copied into the
    message, so the caller may reuse its tensors as soon as ``send`` returns.
    """

    def __init__(self, rank: int, *, host: str = "127.0.0.1", ctx: zmq.Context | None = None) -> None:
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        self._host = host
        super().__init__(rank, ctx)

    def _bind(self, sock: zmq.Socket) -> str:
        if self._host.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)
        port = sock.bind_to_random_port(f"tcp://{self._host}")
        return f"tcp://{self._host}:{port}"

    def _encode(self, key: str, tensors: Mapping[str, torch.Tensor]) -> list[zmq.Frame | bytes]:
        return inline_frames(self.rank, key, tensors)

    def _decode(self, frames: list[zmq.Frame]) -> Message:
        return from_inline_frames(frames)


def inline_frames(rank: int, key: str, tensors: Mapping[str, torch.Tensor]) -> list[zmq.Frame | bytes]:
    """A message as ``[msgpack header, tensor bytes, ...]``, one frame per tensor. Frames of
    large tensors that had to be copied anyway go zero-copy; the caller's own memory and
    small tensors are copied."""
    frames: list[zmq.Frame | bytes] = [b""]
    metas = []
    for name, tensor in tensors.items():
        wire = to_wire_tensor(tensor)
        meta = tensor_header(name, wire)
        metas.append(meta)
        copy = meta.nbytes < _ZERO_COPY_MIN or not is_fresh_copy(wire, tensor)
        frames.append(zmq.Frame(byte_view(wire).numpy(), copy=copy))
    frames[0] = encode_header(MessageHeader(key=key, src=rank, tensors=tuple(metas)))
    return frames


def from_inline_frames(frames: list[zmq.Frame]) -> Message:
    """The message of ``inline_frames``; every tensor is copied out of its frame."""
    header = decode_header(frames[0].buffer)
    if len(frames) != len(header.tensors) + 1:
        raise ValueError(f"expected {len(header.tensors) + 1} frames, got {len(frames)}")
    tensors: dict[str, torch.Tensor] = {}
    for meta, frame in zip(header.tensors, frames[1:]):
        if len(frame) != meta.nbytes:
            raise ValueError(f"tensor {meta.name!r}: frame has {len(frame)} bytes, header says {meta.nbytes}")
        tensors[meta.name] = tensor_from_buffer(meta, frame.buffer)
    return header.key, tensors
