"""Tests of the point-to-point tensor transports (inproc, shm, tcp)."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from mstar.runtime.transport import TensorTransport, make_transport
from mstar.runtime.transport.inproc import InProcessHub
from tests.support.markers import needs_cuda

PROTOCOLS = ["inproc", "shm", "tcp"]
WAIT_S = 10.0


# ------------------------------------------------------------------- helpers


def _sample() -> dict[str, torch.Tensor]:
    """Deterministic tensors covering dtypes and awkward shapes."""
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(64, 64, generator=g)
    return {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "fp16_scalar": torch.tensor(3.5, dtype=torch.float16),
        "fp32": torch.randn(7, generator=g),
        "int64": torch.randint(-(2**62), 2**62, (4, 2), generator=g, dtype=torch.int64),
        "bool": torch.randint(0, 2, (9,), generator=g).bool(),
        "uint8": torch.randint(0, 256, (2, 3, 4), generator=g, dtype=torch.uint8),
        "empty": torch.zeros(0, 7),
        "empty_bool": torch.zeros(3, 0, dtype=torch.bool),
        "large": torch.randn(2 * 1024 * 1024, generator=g),  # 8 MiB
        "strided": base[:, ::3],
        "transposed": base.t()[:10],
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, including dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _same_dict(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def _recv_n(t: TensorTransport, n: int, timeout: float = WAIT_S) -> list[tuple[str, dict[str, torch.Tensor]]]:
    out: list[tuple[str, dict[str, torch.Tensor]]] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"received {len(out)} of {n} messages"
        out.extend(t.recv(timeout=remaining))
    assert len(out) == n
    return out


@pytest.fixture
def world() -> Iterator[Callable[[str, int], list[TensorTransport]]]:
    """Factory of fully connected transports, closed at teardown."""
    made: list[TensorTransport] = []

    def build(protocol: str, n: int) -> list[TensorTransport]:
        hub = InProcessHub()
        ranks = [make_transport(protocol, r, hub=hub) for r in range(n)]
        made.extend(ranks)
        addresses = {t.rank: t.address for t in ranks}
        for t in ranks:
            t.connect(addresses)
        return ranks

    yield build
    for t in made:
        t.close()


# -------------------------------------------------------------- all protocols


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_round_trip(world, protocol: str) -> None:
    a, b = world(protocol, 2)
    sent = _sample()
    a.send(1, "req-1", sent)
    expected = {k: v.clone() for k, v in sent.items()}
    for t in sent.values():  # the sender may reuse its buffers right after send
        t.fill_(1)
    [(key, got)] = _recv_n(b, 1)
    assert key == "req-1"
    assert _same_dict(got, expected)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in got.values())
    got["large"].add_(1)  # received tensors are owned and writable
    assert b.recv() == [] and a.recv() == []


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("protocol", ["shm", "tcp"])
def test_every_dtype(world, protocol: str) -> None:
    a, b = world(protocol, 2)
    tensors = {}
    for dtype in {d for d in vars(torch).values() if isinstance(d, torch.dtype)}:
        if str(dtype).startswith(("torch.qint", "torch.quint")):
            continue  # quantized tensors are not plain byte buffers
        try:
            t = torch.empty(2, 3, dtype=dtype)
            t.reshape(-1).view(torch.uint8).copy_(torch.randint(0, 256, (6 * t.element_size(),), dtype=torch.uint8))
        except (RuntimeError, NotImplementedError):
            continue  # dtypes without basic kernels
        tensors[str(dtype)] = t
    assert len(tensors) > 20
    a.send(1, "dtypes", tensors)
    [(_, got)] = _recv_n(b, 1)
    assert _same_dict(got, tensors)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_ordering_from_one_sender(world, protocol: str) -> None:
    a, b = world(protocol, 2)
    for i in range(50):
        a.send(1, f"m{i}", {"i": torch.tensor(i), "pad": torch.full((i,), i, dtype=torch.int32)})
    got = _recv_n(b, 50)
    assert [k for k, _ in got] == [f"m{i}" for i in range(50)]
    assert [int(t["i"]) for _, t in got] == list(range(50))
    assert all(torch.equal(t["pad"], torch.full((i,), i, dtype=torch.int32)) for i, (_, t) in enumerate(got))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_two_senders(world, protocol: str) -> None:
    a, b, c = world(protocol, 3)

    def produce(t: TensorTransport) -> None:
        for i in range(20):
            t.send(2, f"{t.rank}:{i}", {"x": torch.full((100,), float(i))})

    threads = [threading.Thread(target=produce, args=(t,)) for t in (a, b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = _recv_n(c, 40)
    for src in (0, 1):
        mine = [(k, v) for k, v in got if k.startswith(f"{src}:")]
        assert [k for k, _ in mine] == [f"{src}:{i}" for i in range(20)]
        assert all(torch.equal(v["x"], torch.full((100,), float(i))) for i, (_, v) in enumerate(mine))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_send_does_not_wait_for_receiver(world, protocol: str) -> None:
    a, b = world(protocol, 2)
    n = 1200  # more than ZeroMQ's default high-water mark of 1000 messages

    def produce() -> None:
        for i in range(n):
            a.send(1, str(i), {"x": torch.tensor(i)})

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    producer.join(WAIT_S)
    assert not producer.is_alive(), "send blocked on a receiver that is not reading"
    assert [int(t["x"]) for _, t in _recv_n(b, n)] == list(range(n))


@needs_cuda
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cuda_tensors_arrive_on_cpu(world, protocol: str) -> None:
    a, b = world(protocol, 2)
    x = torch.randn(5, 7, device="cuda")
    a.send(1, "gpu", {"x": x, "s": x[:, ::2]})
    [(_, got)] = _recv_n(b, 1)
    assert got["x"].device.type == "cpu"
    assert torch.equal(got["x"], x.cpu()) and torch.equal(got["s"], x[:, ::2].cpu())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_recv_timeout(world, protocol: str) -> None:
    (a,) = world(protocol, 1)
    start = time.monotonic()
    assert a.recv() == []
    assert a.recv(timeout=0) == []
    assert time.monotonic() - start < 0.1
    start = time.monotonic()
    assert a.recv(timeout=0.3) == []
    assert 0.28 <= time.monotonic() - start < 1.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_blocking_recv_wakes_up(world, protocol: str) -> None:
    a, b = world(protocol, 2)
    timer = threading.Timer(0.1, a.send, args=(1, "late", {"x": torch.ones(3)}))
    timer.start()
    start = time.monotonic()
    got = b.recv(timeout=None)
    timer.join()
    assert [k for k, _ in got] == ["late"]
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_self_send(world, protocol: str) -> None:
    (a,) = world(protocol, 1)
    x = torch.arange(10, dtype=torch.float16)
    a.send(0, "self", {"x": x, "s": x[::2]})
    x.zero_()
    [(key, got)] = a.recv(timeout=1.0)
    assert key == "self"
    assert torch.equal(got["x"], torch.arange(10, dtype=torch.float16))
    assert torch.equal(got["s"], torch.arange(0, 10, 2, dtype=torch.float16))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_errors(world, protocol: str) -> None:
    a, b = world(protocol, 2)
    with pytest.raises(KeyError):
        a.send(5, "nowhere", {})
    with pytest.raises(TypeError):
        a.send(1, "bad", {"x": [1, 2]})  # type: ignore[dict-item]
    a.send(1, "no-tensors", {})
    assert _recv_n(b, 1) == [("no-tensors", {})]
    a.close()
    a.close()  # idempotent
    with pytest.raises(RuntimeError):
        a.send(1, "closed", {})


def test_make_transport_protocols() -> None:
    with pytest.raises(ValueError, match="inproc.*shm.*tcp"):
        make_transport("carrier-pigeon", 0)
    t = make_transport("TCP", 0)
    assert t.address.startswith("tcp://127.0.0.1:")
    t.close()


# ------------------------------------------------------------ shm cleanup


def _segments(*ts: TensorTransport) -> list[str]:
    return [p for t in ts for p in glob.glob(f"/dev/shm/{t.segment_prefix}*")]  # type: ignore[attr-defined]


def _large() -> torch.Tensor:
    """A tensor just over what the shm transport sends inline: it goes through a segment."""
    from mstar.runtime.transport.shm import INLINE_MAX_BYTES

    return torch.arange(INLINE_MAX_BYTES // 4 + 1, dtype=torch.float32)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_shm_sends_small_messages_inline_and_large_ones_through_a_segment() -> None:
    from mstar.runtime.transport.shm import INLINE_MAX_BYTES

    a, b = make_transport("shm", 0), make_transport("shm", 1)
    try:
        a.connect({1: b.address})
        at_limit = {"x": torch.arange(INLINE_MAX_BYTES // 8, dtype=torch.int64), "empty": torch.ones(0)}
        a.send(1, "small", at_limit)
        assert _segments(a) == []  # no segment for a message at the limit
        a.send(1, "large", {"x": _large(), "y": torch.ones(3)})
        assert len(_segments(a)) == 1
        [(k1, small), (k2, large)] = _recv_n(b, 2)
        assert (k1, k2) == ("small", "large") and _segments(a) == []
        assert _same_dict(small, at_limit) and _same_dict(large, {"x": _large(), "y": torch.ones(3)})
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
@pytest.mark.parametrize("first_closed", ["sender", "receiver"])
def test_shm_unconsumed_segments_removed_on_close(first_closed: str) -> None:
    a, b = make_transport("shm", 0), make_transport("shm", 1)
    a.connect({1: b.address})
    b.connect({0: a.address})
    a.send(1, "consumed", {"x": _large()})
    assert [k for k, _ in _recv_n(b, 1)] == ["consumed"]
    assert _segments(a) == []
    for i in range(3):
        a.send(1, f"m{i}", {"x": _large()})
    assert len(_segments(a)) == 3
    (a if first_closed == "sender" else b).close()
    (b if first_closed == "sender" else a).close()
    assert _segments(a, b) == []
    ipc = [t.address.removeprefix("ipc://") for t in (a, b) if t.address.startswith("ipc://")]
    assert not any(os.path.exists(p) for p in ipc)


# ------------------------------------------------------- across processes


def _payload(variant: str) -> dict[str, torch.Tensor]:
    """The sample, plus a tensor that takes shm's segment path for ``shm-large``."""
    return {**_sample(), "large": _large()} if variant == "shm-large" else _sample()


def _exchange_as_child(variant: str, parent_address: str, conn) -> str:
    """Rank 1 in the child: send the sample to rank 0 and check its echo."""
    t = make_transport(variant.removesuffix("-large"), 1)
    try:
        conn.send((t.address, getattr(t, "segment_prefix", "")))
        t.connect({0: parent_address})
        t.send(0, "from-child", _payload(variant))
        [(key, got)] = _recv_n(t, 1)
        ok = key == "echo" and _same_dict(got, {**_payload(variant), "ack": torch.tensor(True)})
        return "ok" if ok else f"bad echo: {key}"
    finally:
        t.close()


def _child_main(conn) -> None:
    """Spawned peer process: serve exchange requests until told to stop."""
    while (request := conn.recv()) is not None:
        try:
            conn.send(_exchange_as_child(*request, conn))
        except Exception as exc:  # report instead of dying silently
            conn.send(f"error: {exc!r}")


@pytest.fixture(scope="module")
def child_conn():
    """One spawned child shared by the cross-process tests (spawning costs seconds)."""
    spawn = mp.get_context("spawn")
    mine, theirs = spawn.Pipe()
    child = spawn.Process(target=_child_main, args=(theirs,), daemon=True)
    child.start()
    yield mine
    mine.send(None)
    child.join(10)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0


@pytest.mark.parametrize("variant", ["shm", "shm-large", "tcp"])
def test_across_processes(child_conn, variant: str) -> None:
    protocol = variant.removesuffix("-large")
    parent = make_transport(protocol, 0)
    try:
        child_conn.send((variant, parent.address))
        assert child_conn.poll(30), "child did not start its transport"
        child_address, child_prefix = child_conn.recv()
        parent.connect({1: child_address})
        [(key, got)] = _recv_n(parent, 1, timeout=30)
        assert key == "from-child"
        assert _same_dict(got, _payload(variant))
        parent.send(1, "echo", {**got, "ack": torch.tensor(True)})
        assert child_conn.poll(30), "child did not answer"
        assert child_conn.recv() == "ok"
    finally:
        parent.close()
    if protocol == "shm" and os.path.isdir("/dev/shm"):
        assert _segments(parent) == []
        assert glob.glob(f"/dev/shm/{child_prefix}*") == []


def _send_and_die(parent_address: str, conn) -> None:
    """A rank that sends a message nobody reads and dies without closing its transport."""
    t = make_transport("shm", 1)
    t.connect({0: parent_address})
    t.send(0, "never-read", {"x": _large()})
    conn.send((t.address, t.segment_prefix))
    conn.recv()  # killed while waiting here


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_killed_processes_socket_file_and_segments_are_removed() -> None:
    from mstar.runtime.transport.shm import remove_leftovers

    parent = make_transport("shm", 0)
    spawn = mp.get_context("spawn")
    mine, theirs = spawn.Pipe()
    child = spawn.Process(target=_send_and_die, args=(parent.address, theirs), daemon=True)
    child.start()
    try:
        assert mine.poll(30), "child did not send"
        address, prefix = mine.recv()
        child.kill()
        child.join(10)
        ipc = address.removeprefix("ipc://")
        assert glob.glob(f"/dev/shm/{prefix}*") and (not address.startswith("ipc://") or os.path.exists(ipc))
        assert remove_leftovers(child.pid) >= 1
        assert glob.glob(f"/dev/shm/{prefix}*") == [] and not os.path.exists(ipc)
        assert remove_leftovers(child.pid) == 0
    finally:
        parent.close()
