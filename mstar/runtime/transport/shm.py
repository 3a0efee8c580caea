"""Same-host shared-memory transport (POSIX).

A message over ``INLINE_MAX_BYTES`` of tensors goes through one fresh POSIX shared-memory
segment (``/dev/shm/mstar_<tag>_<n>`` on Linux): the sender writes every tensor into it
and sends only the msgpack header over a ZeroMQ ``ipc://`` PUSH/PULL socket; the receiver
attaches, copies the tensors out into memory it owns and unlinks the segment. A smaller
message travels inside the ZeroMQ message itself, as over TCP (``inline_frames``): a fresh
segment costs its creation, mapping and page faults on both sides, more than copying a
few hundred KB through the socket (``benchmarks/transport_cost.py``). Most messages are
small: a request's prompt ids, a step's sampled tokens, a codec window.

Cleanup: consumed segments are unlinked by the receiver; ``close()`` on the receiver
unlinks segments of messages it never read, and ``close()`` on the sender unlinks
segments it created that were not consumed yet (those messages are thereby dropped).
Segments are handled with ``shm_open``/``mmap`` directly rather than through
``multiprocessing.shared_memory``, which would register them with Python's
``resource_tracker``; the tracker warns about (and unlinks) segments that change hands
between processes, and talking to it costs a round trip per message.
"""

from __future__ import annotations

import glob
import itertools
import mmap
import os
import secrets
import tempfile
from collections.abc import Mapping

import torch
import zmq

from mstar.runtime.transport.base import (
    Message,
    MessageHeader,
    TensorHeader,
    decode_header,
    encode_header,
    tensor_from_buffer,
    tensor_header,
    to_wire_tensor,
    write_bytes,
)
from mstar.runtime.transport.tcp import ZmqTransport, from_inline_frames, inline_frames

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX platforms
    _posixshmem = None

__all__ = ["ShmTransport", "remove_leftovers"]

_ALIGN = 64
"""Byte alignment of every tensor inside a segment."""

_PRUNE_MIN = 256
"""Number of outstanding segment names that triggers a check for consumed ones."""

_SHM_DIR = "/dev/shm"

INLINE_MAX_BYTES = 1 << 20
"""Messages with at most this many bytes of tensors travel inside the ZeroMQ message."""


def _create_segment(name: str, size: int) -> mmap.mmap:
    """Create a new segment of ``size`` bytes and map it (the name must be unused)."""
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except BaseException:
        _unlink_segment(name)
        raise
    finally:
        os.close(fd)


def _attach_segment(name: str) -> mmap.mmap:
    """Map an existing segment; ``FileNotFoundError`` if it is gone."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _unlink_segment(name: str) -> None:
    """Remove a segment name; a missing one (already consumed) is fine."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def _ipc_path(pid: int, tag: str) -> str:
    """Where a transport of process ``pid`` binds its ``ipc://`` socket."""
    path = os.path.join(tempfile.gettempdir(), f"mstar-{pid}-{tag}.ipc")
    return path if len(path) <= 100 else f"/tmp/mstar-{pid}-{tag}.ipc"  # AF_UNIX path limit


def remove_leftovers(pid: int) -> int:
    """Remove what the transports of the dead process ``pid`` could not: their ``ipc://``
    socket files and the segments they sent that no receiver consumed (a killed worker's
    would otherwise hold shared memory until the host reboots). Returns how many went."""
    removed = 0
    for directory in {tempfile.gettempdir(), "/tmp"}:
        for path in glob.glob(os.path.join(glob.escape(directory), f"mstar-{pid}-*.ipc")):
            tag = os.path.basename(path)[len(f"mstar-{pid}-"):-len(".ipc")]
            segments = glob.glob(os.path.join(_SHM_DIR, f"mstar_{glob.escape(tag)}_*"))
            for segment in segments:
                _unlink_segment(os.path.basename(segment))
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            removed += 1 + len(segments)
    return removed


class ShmTransport(ZmqTransport):
    """Tensor bytes via POSIX shared memory, headers via ZeroMQ ``ipc://``."""

    _LINGER_MS = 0  # close() unlinks unconsumed segments, so undelivered headers are moot

    def __init__(self, rank: int, *, ctx: zmq.Context | None = None) -> None:
        if _posixshmem is None:
            raise RuntimeError("the shm transport needs POSIX shared memory")
        tag = secrets.token_hex(4)
        self.segment_prefix = f"mstar_{tag}_"
        """Every segment this rank creates is named ``segment_prefix + <n>``."""
        self._ipc_path = _ipc_path(os.getpid(), tag)
        self._counter = itertools.count()
        self._pending: dict[str, None] = {}  # segments created and maybe not consumed yet
        self._prune_at = _PRUNE_MIN
        super().__init__(rank, ctx)

    def _bind(self, sock: zmq.Socket) -> str:
        if zmq.has("ipc"):
            address = f"ipc://{self._ipc_path}"
            sock.bind(address)
            return address
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        return f"tcp://127.0.0.1:{port}"

    def _encode(self, key: str, tensors: Mapping[str, torch.Tensor]) -> list[zmq.Frame | bytes]:
        if sum(t.numel() * t.element_size() for t in tensors.values()) <= INLINE_MAX_BYTES:
            return inline_frames(self.rank, key, tensors)
        wires = [(name, to_wire_tensor(tensor)) for name, tensor in tensors.items()]
        offsets: list[int] = []
        size = 0
        for _, wire in wires:
            offset = -(-size // _ALIGN) * _ALIGN
            offsets.append(offset)
            size = offset + wire.numel() * wire.element_size()
        segment = ""
        if size:
            segment = f"{self.segment_prefix}{next(self._counter):x}"
            mapping = _create_segment(segment, size)
            self._pending[segment] = None
            try:
                with memoryview(mapping) as buf:
                    for (_, wire), offset in zip(wires, offsets):
                        write_bytes(wire, buf, offset)
            except BaseException:
                self._forget(segment)
                raise
            finally:
                mapping.close()
            if len(self._pending) >= self._prune_at:
                self._prune_pending()
        metas = tuple(
            tensor_header(name, wire, segment if wire.numel() else "", offset)
            for (name, wire), offset in zip(wires, offsets)
        )
        return [encode_header(MessageHeader(key=key, src=self.rank, tensors=metas))]

    def _decode(self, frames: list[zmq.Frame]) -> Message:
        if len(frames) > 1:  # tensors inline (a segment's header travels alone)
            return from_inline_frames(frames)
        header = decode_header(frames[0].buffer)
        attached: dict[str, mmap.mmap] = {}
        try:
            tensors: dict[str, torch.Tensor] = {}
            for meta in header.tensors:
                tensors[meta.name] = tensor_from_buffer(meta, self._segment_buf(meta, attached), meta.offset)
            return header.key, tensors
        finally:
            for mapping in attached.values():
                mapping.close()
            for name in _segments(header):
                _unlink_segment(name)

    def _discard(self, frames: list[zmq.Frame]) -> None:
        try:
            for name in _segments(decode_header(frames[0].buffer)):
                _unlink_segment(name)
        except Exception:  # an unreadable header owns nothing we can find
            pass

    def _release(self) -> None:
        for name in self._pending:
            _unlink_segment(name)
        self._pending.clear()
        if self._address.startswith("ipc://"):
            try:
                os.unlink(self._ipc_path)  # libzmq does not always remove it
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _segment_buf(meta: TensorHeader, attached: dict[str, mmap.mmap]) -> mmap.mmap | bytes:
        if not meta.segment:
            return b""
        mapping = attached.get(meta.segment)
        if mapping is None:
            try:
                mapping = attached[meta.segment] = _attach_segment(meta.segment)
            except FileNotFoundError:
                raise ValueError(f"segment {meta.segment!r} is gone (sender closed?)") from None
        return mapping

    def _forget(self, segment: str) -> None:
        self._pending.pop(segment, None)
        _unlink_segment(segment)

    def _prune_pending(self) -> None:
        """Drop names of segments that receivers already unlinked (Linux only)."""
        if os.path.isdir(_SHM_DIR):
            self._pending = {n: None for n in self._pending if os.path.exists(os.path.join(_SHM_DIR, n))}
        self._prune_at = max(_PRUNE_MIN, 2 * len(self._pending))


def _segments(header: MessageHeader) -> set[str]:
    return {meta.segment for meta in header.tensors if meta.segment}
