"""S10's Pi0.5 front end on its own: how ``prepare_generate`` scales over threads.

A server prepares concurrent requests in threads (``asyncio.to_thread``). At 16 observations
on a 16-core GPU host, S10 measured 53.8 ms of front ends (3.3 ms an observation) with the
threads barely overlapping, while on a quiet 2-core machine two threads prepared twice as many
as one. This times the same work in isolation, on the same camera PNGs as S10:

* ``prepare``: ``n`` observations (three 224x224 PNGs, the prompt, the noise) through
  ``spec.prepare_generate`` on a pool of each size in ``--threads``, with the deployment's
  own threads (conductor, worker) alive beside them, and again after it is closed;
* ``decode``: the same ``3n`` PNGs through ``decode_image`` alone, on the same pools;
* ``switch``: ``prepare`` on the largest pool with the interpreter's switch interval at a
  tenth of its default (how often a waiting thread asks for the GIL).

Each figure is the median wall time of ``--runs`` passes, in ms. The deployment is S10's
eager one (dummy weights): only its threads matter here.

    python3 benchmarks/s10_pi05_front.py            # a CUDA host, released shapes
    python3 benchmarks/s10_pi05_front.py --smoke    # the CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Metric, add_run_args, hardware, setup_logging, write_record
from benchmarks.s10_pi05 import TASK, Ours, settings_from, write_policy_dir
from benchmarks.s10_pi05 import parse_args as s10_args

NAME = "s10_pi05_front"
log = logging.getLogger("s10-front")


def timed(pool: ThreadPoolExecutor, work: Callable[[Any], Any], items: list[Any], runs: int) -> float:
    """The median wall time, in ms, of mapping ``work`` over ``items`` on ``pool``."""
    list(pool.map(work, items))  # warm: the pool's threads exist before the clock starts
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        list(pool.map(work, items))
        walls.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(walls)


def sweep(work: Callable[[Any], Any], items: list[Any], threads: list[int], runs: int) -> dict[int, float]:
    out = {}
    for n in threads:
        with ThreadPoolExecutor(n) as pool:
            out[n] = timed(pool, work, items, runs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--observations", type=int, default=16, help="observations a pass prepares")
    p.add_argument("--threads", default="1,2,4,8,16,20", help="pool sizes")
    p.add_argument("--runs", type=int, default=7, help="passes a figure, median")
    add_run_args(p)
    args = p.parse_args(argv)
    setup_logging(args.verbose)
    from mstar.contract import GenerateSpec
    from mstar.media.images import decode_image

    settings = settings_from(s10_args(["--smoke"] if args.smoke else []))
    threads = sorted({int(t) for t in args.threads.split(",")})
    n = args.observations
    results: dict[str, Any] = {"cores": os.cpu_count(), "switch_interval_s": sys.getswitchinterval()}
    with tempfile.TemporaryDirectory(prefix="s10-front-") as tmp:
        ours = Ours(settings, write_policy_dir(settings, Path(tmp) / "policy"), {})
        spec = ours.deployment.spec
        files = [(f"cam{k}.png", img) for k, img in enumerate(ours.images)]
        specs = [GenerateSpec(f"front-{i}", TASK, files, ["action"], {"state": ours.state, "seed": i})
                 for i in range(n)]
        pngs = [img for _ in range(n) for img in ours.images]
        results["prepare"] = sweep(spec.prepare_generate, specs, threads, args.runs)
        results["decode"] = sweep(decode_image, pngs, threads, args.runs)
        default = sys.getswitchinterval()
        sys.setswitchinterval(default / 10)
        try:
            results["switch"] = sweep(spec.prepare_generate, specs, threads[-1:], args.runs)
        finally:
            sys.setswitchinterval(default)
        ours.close()
        results["prepare_closed"] = sweep(spec.prepare_generate, specs, threads, args.runs)
    for part in ("prepare", "prepare_closed", "decode", "switch"):
        log.info("%-15s %s", part, "  ".join(f"{t:>2}: {ms:7.2f} ms" for t, ms in results[part].items()))
    scenario = f"S10 pi05 front end, {n} observations"
    metrics = [Metric(scenario, f"{part} on {t} threads", "ms", "lower", ours=ms)
               for part in ("prepare", "prepare_closed", "decode", "switch") for t, ms in results[part].items()]
    write_record(NAME, {"scenario": scenario, "hardware": hardware(), "results": results, "metrics": metrics},
                 args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
