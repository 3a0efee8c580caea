"""Where a scenario's time goes: one warmed-up batch of ours under the torch profiler.

    python3 benchmarks/profile_gpu.py s1 --streams 1 --attention-backend triton --cuda-graphs --overlap
    python3 benchmarks/profile_gpu.py s4 --batch 1 --cuda-graphs
    python3 benchmarks/profile_gpu.py s2 --batch 1 [--runtime-compile]
    python3 benchmarks/profile_gpu.py s3 --batch 32 --attention-backend triton --cuda-graphs --overlap
    python3 benchmarks/profile_gpu.py s7 --batch 32 [--fused-kernels]
    python3 benchmarks/profile_gpu.py s8 --runtime-compile --fused-kernels --steps 6 --timeline 1
    python3 benchmarks/profile_gpu.py s10 --batch 1 [--compile] [--cuda-graphs]

The scenario's own runner (S1's, S2's, S4's or S7's ``OursRunner``/``ImageRunner``, S8's
``OursClips``, S10's Pi0.5 ``Ours``; S3's deployment in process, its speech requests through
the backend rather than HTTP) starts the deployment on dummy weights, runs the batch
``--warmups`` times (2) unprofiled (kernels compiled, graphs captured), then once inside
``torch.profiler``. Printed: the batch's wall time, how long the GPU was busy in it (the union
of kernel intervals) and so how much of the wall was host-bound, the time of each runtime node
(``mstar.node.<name>`` ranges the worker opens), the kernels by total GPU time and the host
ops by self CPU time. ``--out DIR`` also writes the full tables and (``--trace``) a Chrome
trace there. ``--smoke`` runs on the CPU with the scenario's tiny model (no GPU figures).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile


def _s1(args: argparse.Namespace, tmp: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    from benchmarks import s1_llama_decode as s1
    from benchmarks.common import tiny_llama_dir

    argv = ["--streams", str(args.batch), "--skip-baseline", *args.scenario_args]
    settings = s1.settings_from(s1.parse_args(argv + (["--smoke"] if args.smoke else [])))
    runner = s1.OursRunner(settings, tiny_llama_dir(tmp, **settings.model))
    return (lambda: runner.run(args.batch, settings.new_tokens)), runner.close


def _s2(args: argparse.Namespace, tmp: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    from benchmarks import s2_flux2_klein as s2

    argv = ["--batches", str(args.batch), *args.scenario_args]
    settings = s2.settings_from(s2.parse_args(argv + (["--smoke"] if args.smoke else [])))
    runner = s2.ImageRunner(settings, s2.klein_dir(tmp, settings))
    return (lambda: runner.run(args.batch)), runner.close


def _s3(args: argparse.Namespace, tmp: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    """S3's deployment in process (its worker in this process, so the profiler sees the
    talker's and the codec's kernels) and ``--batch`` concurrent speech requests."""
    import asyncio

    from benchmarks import s3_orpheus as s3
    from mstar.config import parse_config
    from mstar.contract import SpeechSpec
    from mstar.runtime.launch import start

    argv = ["--streams", str(args.batch), *args.scenario_args]
    settings = s3.settings_from(s3.parse_args(argv + (["--smoke"] if args.smoke else [])))
    deployment = start(parse_config(s3.deployment(settings, s3.tiny_llama_dir(Path(tmp), **settings.model))),
                       in_process=True)
    ids = iter(range(1 << 30))

    async def speak_all():
        async def one():
            spec = SpeechSpec(f"profile-{next(ids)}", s3.TEXT, "tara")  # speaks the deployment's max_new_tokens
            return [event async for event in deployment.backend.speech(spec)]

        return await asyncio.gather(*(one() for _ in range(args.batch)))

    return (lambda: asyncio.run(speak_all())), deployment.close


def _s4(args: argparse.Namespace, tmp: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    from benchmarks import s4_whisper as s4
    from benchmarks.common import whisper_dir

    argv = ["--batches", str(args.batch), "--skip-baseline", *args.scenario_args]
    settings = s4.settings_from(s4.parse_args(argv + (["--smoke"] if args.smoke else [])))
    runner = s4.OursRunner(settings, whisper_dir(tmp, **settings.model))
    return (lambda: runner.run(args.batch, settings.new_tokens)), runner.close


def _s7(args: argparse.Namespace, tmp: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    """S7's Kokoro deployment in process (the checkpoint S7 writes with the ``kokoro``
    package) and ``--batch`` concurrent requests of its phonemes."""
    from benchmarks import s7_tts as s7

    model_dir = Path(tmp) / "kokoro"
    s7.write_checkpoint(model_dir, s7.reference_config(args.smoke), 0)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    runner = s7.OursRunner(model_dir, device, args.batch, args.fused_kernels and device == "cuda")
    return (lambda: runner.run(args.batch)), runner.close


def _s10(args: argparse.Namespace, tmp: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    """S10's Pi0.5 deployment in process (its policy directory, dummy weights) and ``--batch``
    observations submitted at once."""
    from benchmarks import s10_pi05 as s10

    argv = ["--batches", str(args.batch), "--skip-baseline", *args.scenario_args]
    settings = s10.settings_from(s10.parse_args(argv + (["--smoke"] if args.smoke else [])))
    variant = {**({"compile": True} if args.compile else {}), **({"cuda_graphs": True} if args.cuda_graphs else {})}
    runner = s10.Ours(settings, s10.write_policy_dir(settings, Path(tmp) / "policy"), variant)
    return (lambda: runner.run(args.batch)), runner.close


def _s8(args: argparse.Namespace, tmp: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    """S8's ``wan22`` deployment in process and one clip of ``--steps`` (default 6) denoise
    steps: a short clip, so the GPU-idle stretches between steps show in the timeline."""
    from benchmarks import s8_wan22 as s8

    rest = list(args.scenario_args)
    if "--steps" not in rest:
        rest += ["--steps", "6"]
    settings = s8.settings_from(s8.parse_args(rest + (["--smoke"] if args.smoke else [])))
    runner = s8.OursClips(settings, s8.wan_dir(Path(tmp) / "model", settings), settings.vae_dtype.split(",")[0])
    return (lambda: runner.clip(settings.steps)), runner.close


SCENARIOS = {"s1": _s1, "s2": _s2, "s3": _s3, "s4": _s4, "s7": _s7, "s8": _s8, "s10": _s10}


def busy_seconds(events) -> float:
    """Seconds during which at least one GPU kernel or copy ran (the union of their
    intervals; the GPU-side spans of labelled ranges are not work and are left out)."""
    return sum(e - s for s, e in _gpu_spans(events)) * 1e-6  # microseconds


def _gpu_spans(events) -> list[tuple[float, float]]:
    """The merged intervals (microseconds) during which a kernel or copy ran."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                   and not getattr(e, "is_user_annotation", False) and not e.name.startswith("mstar."))
    merged: list[list[float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def timeline(events, min_gap_ms: float) -> str:
    """When each runtime node ran on the host, and every stretch of at least ``min_gap_ms``
    with the GPU idle, with the host work that overlapped it most (times from the first
    event, ms)."""
    cpu = [e for e in events
           if e.device_type == torch.autograd.DeviceType.CPU and e.time_range.end > e.time_range.start]
    spans = _gpu_spans(events)
    origin = min([e.time_range.start for e in cpu] + [s for s, _ in spans])
    ms = lambda t: (t - origin) / 1e3  # noqa: E731
    lines = ["host ranges of the nodes (start-end ms):"]
    for e in sorted((e for e in cpu if e.name.startswith("mstar.node.")), key=lambda e: e.time_range.start):
        lines.append(f"  {ms(e.time_range.start):8.1f} - {ms(e.time_range.end):8.1f}  {e.name[11:]}")
    if spans:
        lines.append(f"GPU busy from {ms(spans[0][0]):.1f} to {ms(spans[-1][1]):.1f} ms; "
                     f"idle stretches >= {min_gap_ms} ms:")
    edges = [(origin, spans[0][0])] if spans else []
    edges += [(a[1], b[0]) for a, b in zip(spans, spans[1:])]
    for g0, g1 in edges:
        if (g1 - g0) / 1e3 < min_gap_ms:
            continue
        overlaps = sorted(((min(e.time_range.end, g1) - max(e.time_range.start, g0), e) for e in cpu
                           if e.time_range.start < g1 and e.time_range.end > g0
                           and e.time_range.end - e.time_range.start < 5 * (g1 - g0)), key=lambda p: -p[0])
        what = "; ".join(f"{e.name[:48]} {o / 1e3:.1f}" for o, e in overlaps[:5])
        lines.append(f"  {ms(g0):8.1f} - {ms(g1):8.1f} ({(g1 - g0) / 1e3:5.1f} ms)  {what}")
    return "\n".join(lines)


def _device_us(avg) -> float:
    return getattr(avg, "device_time_total", None) or getattr(avg, "cuda_time_total", 0.0)


def summary(prof, wall: float, top: int) -> str:
    events = prof.events()
    busy = busy_seconds(events)
    averages = prof.key_averages()
    lines = [f"wall {wall * 1e3:.1f} ms; GPU busy {busy * 1e3:.1f} ms ({100 * busy / wall:.0f}% of the wall)"]
    nodes = sorted((a for a in averages if a.key.startswith("mstar.node.")), key=lambda a: -a.cpu_time_total)
    for a in nodes:
        lines.append(f"  node {a.key[11:]:<16} calls {a.count:>5}  host {a.cpu_time_total / 1e3:9.1f} ms  "
                     f"device {_device_us(a) / 1e3:9.1f} ms")
    kernels = sorted((a for a in averages if _device_us(a) > 0 and a.self_cpu_time_total == 0 and
                      not a.key.startswith("mstar.node.")), key=lambda a: -_device_us(a))
    lines.append(f"top kernels by GPU time (of {busy * 1e3:.1f} ms busy):")
    for a in kernels[:top]:
        us = _device_us(a)
        lines.append(f"  {us / 1e3:8.2f} ms {a.count:>6}x {us / max(a.count, 1):8.1f} us  {a.key[:90]}")
    host = sorted((a for a in averages if a.self_cpu_time_total > 0), key=lambda a: -a.self_cpu_time_total)
    lines.append("top host ops by self CPU time:")
    for a in host[:top]:
        lines.append(f"  {a.self_cpu_time_total / 1e3:8.2f} ms {a.count:>6}x  {a.key[:90]}")
    return "\n".join(lines)


def _all_threads():
    """Profile every thread (the runtime's conductor thread runs the engines), where this
    torch can; else only the calling thread is seen."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        print("this torch profiles the calling thread only: engine work is not seen")
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--batch", type=int, default=1, help="streams, images or clips submitted at once")
    p.add_argument("--fused-kernels", action="store_true", help=
                   "s7: the vocoder's fused AdaIN kernels (others: passed on)")
    p.add_argument("--compile", action="store_true", help="s10: the action expert's blocks compiled")
    p.add_argument("--cuda-graphs", action="store_true", help=
                   "s10: each denoise step from a CUDA graph (others: passed on)")
    p.add_argument("--top", type=int, default=20, help="rows per table")
    p.add_argument("--warmups", type=int, default=2, help="unprofiled batches first (captures, compiles)")
    p.add_argument("--smoke", action="store_true", help="the scenario's tiny model on the CPU")
    p.add_argument("--out", default=None, help="directory for the full tables (and the trace)")
    p.add_argument("--trace", action="store_true", help="also write a Chrome trace to --out")
    p.add_argument("--timeline", type=float, default=None, metavar="MS",
                   help="also print the nodes' host ranges and every GPU-idle stretch of at least MS ms")
    args, rest = p.parse_known_args(argv)
    # the two flags this parser takes for s7 and s10 are the other scenarios' own: pass them on
    # (until 2026-12-07 they were swallowed, and e.g. an S4 profile "with graphs" ran eagerly)
    for flag, owner in (("fused_kernels", "s7"), ("cuda_graphs", "s10")):
        if getattr(args, flag) and args.scenario != owner:
            rest.append("--" + flag.replace("_", "-"))
    args.scenario_args = rest  # the scenario script's own flags (e.g. --cuda-graphs)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        run, close = SCENARIOS[args.scenario](args, tmp)
        try:
            for _ in range(args.warmups):
                run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            with profile(activities=activities, experimental_config=_all_threads()) as prof:
                start = time.perf_counter()
                run()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                wall = time.perf_counter() - start
        finally:
            close()
    text = summary(prof, wall, args.top)
    if args.timeline is not None:
        text += "\n" + timeline(prof.events(), args.timeline)
    print(f"{args.scenario} batch {args.batch} {' '.join(args.scenario_args)}\n{text}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"profile-{args.scenario}-{args.batch}"
        (out / f"{stem}.txt").write_text(text + "\n\n" + prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=200))
        (out / f"{stem}.json").write_text(json.dumps({"argv": sys.argv, "wall_s": wall}))
        if args.trace:
            prof.export_chrome_trace(str(out / f"{stem}.trace.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
