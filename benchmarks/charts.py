"""One chart per scenario from the benchmarks' JSON records: ours, the baseline and the floor.

    python benchmarks/charts.py RECORD_OR_DIR [...] [--out docs/img]

Each argument is a record (``<name>-<date>.json``, as ``common.write_record`` writes it) or a
directory of them. For every scenario name the newest record (its ``date``) is drawn into
``<out>/<name>.png``: one panel per metric kind (``throughput``, ``image``, ``rtf``,
``ttft_p50`` ...), each with grouped bars of ours, the baseline and the floor at every stream
count, batch or clip count of the record. Times per token or per image are drawn as rates
(tokens/s, images/s), so that every panel reads "higher is better" alike; other times (ms)
are drawn as they are, and the panel says "lower is better". A scenario whose baseline is
not an outside system says so in the legend (S5's baseline is ours with the cache off).

Needs matplotlib (the ``dev`` extras); nothing else of the benchmarks' GPU dependencies.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "img"
_NAME = re.compile(r"^(?P<kind>.+?)@(?P<n>\d+)(?P<rest>.*)$")
# (unit of a time, the rate it becomes, seconds in one of that unit)
_AS_RATE = {"ms/token": ("tok/s", 1e-3), "s/image": ("images/s", 1.0)}
# what the bars of ours and the baseline are, where it is not "ours (M*)" and "baseline"
_SIDES = {"s5_shared_prefix": ("ours, prefix cache on", "ours, prefix cache off")}
_BASELINES = {"s1_llama_decode": "transformers", "s2_flux2_klein": "diffusers", "s4_whisper": "transformers",
              "s9_qwen3_omni": "transformers", "s10_pi05": "transformers", "s11_world": "no baseline",
              "s13_qwen3_asr": "transformers", "s10_bagel": "bagel2"}
COLOURS = {"ours": "#1f77b4", "baseline": "#ff7f0e", "floor": "#9e9e9e", "other": "#2ca02c"}


@dataclass
class Point:
    """One bar group: ours, the baseline and the floor at one count ``n``."""

    n: int
    ours: float | None
    baseline: float | None
    floor: float | None


def load(paths: list[str]) -> dict[str, dict[str, Any]]:
    """The newest record of every scenario name among ``paths`` (files or directories)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        files.extend(sorted(path.glob("*.json")) if path.is_dir() else [path])
    newest: dict[str, dict[str, Any]] = {}
    for file in files:
        try:
            record = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"skipping {file}: {err}", file=sys.stderr)
            continue
        if not isinstance(record, dict) or "name" not in record or "metrics" not in record:
            print(f"skipping {file}: not a benchmark record", file=sys.stderr)
            continue
        name = record["name"]
        if name not in newest or record.get("date", "") > newest[name].get("date", ""):
            newest[name] = record
    return newest


def panels(record: dict[str, Any]) -> dict[tuple[str, str, bool], list[Point]]:
    """The record's metrics grouped by kind: ``(title, unit, higher_is_better) -> points``.

    A metric ``kind@N rest`` goes to panel ``kind rest``; a time per token or per image
    becomes a rate (``latency@1`` in ms/token joins ``throughput`` in tok/s as 1 stream)."""
    groups: dict[tuple[str, str, bool], list[Point]] = defaultdict(list)
    usual = _BASELINES.get(record.get("name", ""))  # a baseline named after it is the usual one
    for metric in record["metrics"]:
        match = _NAME.match(metric["metric"])
        if match is None:
            continue
        kind, n, rest = match["kind"], int(match["n"]), match["rest"].strip()
        unit, higher = metric.get("unit") or "", metric.get("better") == "higher"
        values = [metric.get("ours"), metric.get("baseline"), metric.get("floor")]
        if not higher and unit in _AS_RATE:
            unit, seconds = _AS_RATE[unit]
            per_item = n if unit == "tok/s" else 1  # ms per token of each of n streams -> n streams' tok/s
            values = [None if not v else per_item / (v * seconds) for v in values]
            higher = True
            if kind == "latency":
                kind = "throughput"
        title = f"{kind} {rest}".strip()
        baseline_is = (metric.get("notes") or {}).get("baseline_is")
        if baseline_is and not (usual and baseline_is.startswith(usual)):  # e.g. S1's HTTP rows: ours in process
            title += f" (vs {baseline_is.split(' (')[0].split(',')[0]})"
        groups[(title, unit, higher)].append(Point(n, *values))
    for points in groups.values():
        points.sort(key=lambda p: p.n)
    # a kind neither side measured (skipped in that run) has nothing to show beside its floor
    return {key: points for key, points in groups.items() if any(p.ours or p.baseline for p in points)}


def subtitle(record: dict[str, Any]) -> str:
    hw = record.get("hardware") or {}
    device = hw.get("gpu") or f"CPU ({hw.get('cpu') or '?'})"
    return f"{device}, {str(record.get('date', ''))[:10]}"


def draw(record: dict[str, Any], out_dir: Path) -> Path | None:
    """``<out_dir>/<name>.png`` of ``record``; None when it has no chartable metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = panels(record)
    if not groups:
        return None
    name = record["name"]
    ours_label, baseline_label = _SIDES.get(name, ("ours (M*)", _BASELINES.get(name, "baseline")))
    cols = min(3, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.1 * rows + 0.5), squeeze=False)
    width = 0.27
    for ax, ((title, unit, higher), points) in zip(axes.flat, groups.items()):
        xs = range(len(points))
        other = title.partition(" (vs ")[2].rstrip(")")  # a baseline other than the scenario's
        for offset, side, label in ((-width, "ours", ours_label), (0.0, "baseline", other or baseline_label),
                                    (width, "floor", "floor (hardware bound)")):
            heights = [getattr(p, side) or 0.0 for p in points]
            colour = COLOURS["other"] if side == "baseline" and other else COLOURS[side]
            bars = ax.bar([x + offset for x in xs], heights, width, label=label, color=colour)
            for bar, value in zip(bars, (getattr(p, side) for p in points)):
                if value:
                    ax.annotate(_short(value), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=6)
        ax.set_xticks(list(xs), [str(p.n) for p in points])
        ax.set_xlabel("streams / batch", fontsize=8)
        ax.set_ylabel(unit + ("" if higher else " (lower is better)"), fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.15)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    legend: dict[str, Any] = {}  # every panel's bars, once each
    for ax in list(axes.flat)[:len(groups)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    fig.suptitle(f"{record.get('scenario', name)}\n{subtitle(record)}", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _short(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    if value >= 10:
        return f"{value:.0f}"
    return f"{value:.2g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="record files or directories of them")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="directory of the PNGs")
    args = p.parse_args(argv)
    records = load(args.records)
    if not records:
        print("no benchmark records found", file=sys.stderr)
        return 1
    for name in sorted(records):
        path = draw(records[name], Path(args.out))
        print(f"{name}: {path if path else 'no chartable metrics'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
