"""Tensor transport interface, wire header codec and the transport factory.

A :class:`TensorTransport` moves named tensors directly between worker ranks; the
conductor only ever sees metadata. Every message is a ``(key, {name: tensor})`` pair.

Wire format (TCP and SHM): one msgpack-encoded :class:`MessageHeader` describing each
tensor (name, dtype, shape, byte count and, for shared memory, segment and offset),
followed by raw tensor bytes (TCP frames or a shared-memory segment). No pickle.

Device semantics: tensors are detached, made contiguous and copied to CPU on send;
received tensors are always contiguous CPU tensors owned by the receiver. (A later
NCCL transport will keep tensors on the device.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import torch

__all__ = [
    "Message",
    "MessageHeader",
    "TensorHeader",
    "TensorTransport",
    "dtype_from_str",
    "dtype_to_str",
    "PROTOCOLS",
]

Message = tuple[str, dict[str, torch.Tensor]]
"""A received message: ``(key, {tensor name: tensor})``."""

PROTOCOLS: tuple[str, ...] = ("inproc", "shm", "tcp")


# --------------------------------------------------------------------------- codec


class TensorHeader(msgspec.Struct, array_like=True, frozen=True):
    """Wire description of one tensor; ``segment``/``offset`` are used by SHM only."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    segment: str = ""
    offset: int = 0


class MessageHeader(msgspec.Struct, array_like=True, frozen=True):
    """Wire description of one message: its key, sender rank and tensors in order."""

    key: str
    src: int
    tensors: tuple[TensorHeader, ...]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(MessageHeader)

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def encode_header(header: MessageHeader) -> bytes:
    """Serialize a header with msgpack."""
    return _ENCODER.encode(header)


def decode_header(data: Any) -> MessageHeader:
    """Deserialize (and type-check) a header produced by :func:`encode_header`."""
    return _DECODER.decode(data)


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_to_str`; raises ``ValueError`` for unknown names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown torch dtype {name!r}") from None


def to_wire_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Return a detached, contiguous CPU tensor with the same values as ``tensor``.

    The result may alias ``tensor`` (when it already is a contiguous CPU tensor);
    compare ``data_ptr()`` to know whether a fresh copy was made.
    """
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"only dense strided tensors can be sent, got layout {tensor.layout}")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.resolve_conj().resolve_neg().contiguous()


def is_fresh_copy(wire: torch.Tensor, original: torch.Tensor) -> bool:
    """Whether ``wire = to_wire_tensor(original)`` owns its memory (no aliasing)."""
    return wire.numel() > 0 and (original.device.type != "cpu" or wire.data_ptr() != original.data_ptr())


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """Flat ``uint8`` view sharing memory with a contiguous CPU tensor (0-d allowed)."""
    return tensor.reshape(-1).view(torch.uint8)


def tensor_header(name: str, tensor: torch.Tensor, segment: str = "", offset: int = 0) -> TensorHeader:
    """Describe a wire tensor (as returned by :func:`to_wire_tensor`)."""
    return TensorHeader(
        name=name,
        dtype=dtype_to_str(tensor.dtype),
        shape=tuple(tensor.shape),
        nbytes=tensor.numel() * tensor.element_size(),
        segment=segment,
        offset=offset,
    )


def write_bytes(tensor: torch.Tensor, buf: memoryview, offset: int = 0) -> None:
    """Copy the bytes of a wire tensor into the writable buffer ``buf`` at ``offset``."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes:
        torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).copy_(byte_view(tensor))


def tensor_from_buffer(meta: TensorHeader, buf: Any, offset: int = 0) -> torch.Tensor:
    """Build a new (owned) CPU tensor from ``meta.nbytes`` bytes of ``buf`` at ``offset``.

    ``buf`` is any object exposing the buffer protocol (zmq frame, shared memory, bytes);
    the bytes are copied, so ``buf`` may be released afterwards.
    """
    out = torch.empty(meta.shape, dtype=dtype_from_str(meta.dtype))
    expected = out.numel() * out.element_size()
    if expected != meta.nbytes:
        raise ValueError(f"tensor {meta.name!r}: header says {meta.nbytes} bytes, shape needs {expected}")
    if expected:
        with memoryview(buf) as view:
            if view.readonly:  # torch.frombuffer warns on read-only memory; numpy copies quietly
                np.copyto(byte_view(out).numpy(), np.frombuffer(view, np.uint8, expected, offset))
            else:
                byte_view(out).copy_(torch.frombuffer(view, dtype=torch.uint8, count=expected, offset=offset))
    return out


def check_message(key: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Validate the argument types of ``send`` before anything is written."""
    if not isinstance(key, str):
        raise TypeError(f"message key must be a str, got {type(key).__name__}")
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict of name -> tensor, got {type(tensors).__name__}")
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")


def clone_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh contiguous CPU copies (used for local and in-process delivery)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        t = to_wire_tensor(tensor)
        out[name] = t if is_fresh_copy(t, tensor) else t.clone()
    return out


# ----------------------------------------------------------------------- interface


class TensorTransport(ABC):
    """Point-to-point transport of named tensors between ranks.

    Lifecycle: construct (binds/registers), publish :attr:`address`, call
    :meth:`connect` with every other rank's address, then :meth:`send` / :meth:`recv`.
    Messages from one sender to one receiver arrive in send order.
    """

    rank: int

    @property
    @abstractmethod
    def address(self) -> str:
        """How peers reach this rank (pass it to their :meth:`connect`)."""

    @abstractmethod
    def connect(self, peers: dict[int, str]) -> None:
        """Register peers: rank -> address (own rank, if present, is ignored)."""

    @abstractmethod
    def send(self, dst: int, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Send ``tensors`` to rank ``dst`` under ``key``.

        Never waits for the receiver to call :meth:`recv`. The caller may modify or
        reuse the tensors as soon as this returns. ``dst == self.rank`` delivers locally.
        """

    @abstractmethod
    def recv(self, timeout: float | None = 0.0) -> list[Message]:
        """Return every message that has arrived, in arrival order.

        Waits up to ``timeout`` seconds for at least one message (``None``: forever,
        ``0``: just poll) and returns ``[]`` if none came.
        """

    @abstractmethod
    def close(self) -> None:
        """Release sockets/queues/segments; idempotent."""

    def __enter__(self) -> TensorTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, address={self.address!r})"
