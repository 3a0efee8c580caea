"""What a tensor hand-off between two worker ranks costs on each transport.

    python3 benchmarks/transport_cost.py [--sizes 4096,1048576,67108864] [--reps 50]

A sender process and a receiver process (spawned, as worker ranks are) exchange float32
tensors of each size over ``shm`` (shared memory + an ``ipc://`` header: ranks on one
node) and ``tcp`` (ZeroMQ over TCP: ranks on different nodes; here over loopback, so the
figure is the transport's own cost without a network's). Printed per size: the median
one-way time of a ping-pong (half a round trip) and the bandwidth it implies. Between
machines add the network: a 25 Gb/s link moves ~3 GB/s at best.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch

from mstar.runtime.transport import make_transport


def _echo(protocol: str, conn) -> None:
    """The receiving rank: sends each message straight back."""
    t = make_transport(protocol, 1)
    conn.send(t.address)
    t.connect({0: conn.recv()})
    try:
        while True:
            for key, tensors in t.recv(timeout=30.0):
                if key == "stop":
                    return
                t.send(0, key, tensors)
    finally:
        t.close()


def measure(protocol: str, sizes: list[int], reps: int) -> dict[int, float]:
    """Median one-way seconds per size in bytes."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    peer = ctx.Process(target=_echo, args=(protocol, theirs), daemon=True)
    peer.start()
    t = make_transport(protocol, 0)
    try:
        t.connect({1: mine.recv()})
        mine.send(t.address)
        out = {}
        for size in sizes:
            x = torch.ones(size // 4)
            times = []
            for i in range(reps + 3):
                start = time.perf_counter()
                t.send(1, f"m{i}", {"x": x})
                while not (got := t.recv(timeout=30.0)):
                    pass
                if i >= 3:  # warm-up: connections, first segments
                    times.append((time.perf_counter() - start) / 2)
                assert got[0][1]["x"].numel() == x.numel()
            out[size] = statistics.median(times)
        t.send(1, "stop", {})
        peer.join(10)
        return out
    finally:
        t.close()
        if peer.is_alive():
            peer.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4096,1048576,16777216,67108864", help="bytes, comma separated")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print("| protocol | bytes | one way | GB/s |\n|---|---|---|---|")
    for protocol in ("shm", "tcp"):
        for size, seconds in measure(protocol, sizes, args.reps).items():
            print(f"| {protocol} | {size:,} | {seconds * 1e3:.3f} ms | {size / seconds / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
